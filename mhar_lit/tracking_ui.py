"""MLflow's web UI for training runs: the experiment-kind tag and links that open the runs list.

MLflow 3.17 has two workflows, GenAI and model training. In GenAI an experiment opens on an "Overview" of
traces, empty for a training run ("No data available"); in model training it opens on its runs list.
- The experiment tag `mlflow.experimentKind` (`custom_model_development` for training, `genai_development`;
  the values MLflow's own experiment-type selector writes) names an experiment's kind for MLflow's clients.
  The 3.17.2 web UI does NOT take its landing page from it (checked in headless chromium, 2026-12-06: a
  tagged experiment still opened on the GenAI overview): its bundle derives the kind from the browser's
  workflow choice instead, the sidebar's GenAI / Model training switch, kept in the browser's local storage
  (`mlflow.workflowType_v1`, GenAI by default) and overridden by `?workflowType=` in a page's URL.
- So what opens the runs list is a link with `?workflowType=machine_learning` (`runs_page_url`), or one
  click on "Model training", which the browser remembers (docs/training.md, Watching runs).
"""

from __future__ import annotations

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
TRAINING_WORKFLOW = "machine_learning"


def mark_training_experiment(client, experiment_id: str) -> bool:
    """Tag the experiment as model training (idempotent; see the module's note on what the 3.17.2 UI reads).
    `client` is an `mlflow.MlflowClient` (what Lightning's `MLFlowLogger.experiment` is). Returns True when
    the tag was written, False when it was already there, so a resumed or repeated run does not rewrite it."""
    experiment = client.get_experiment(experiment_id)  # an unknown id raises MLflow's "No Experiment with id=..."
    if experiment.tags.get(EXPERIMENT_KIND_TAG) == TRAINING_KIND:
        return False
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    return True


def runs_page_url(base_url: str, experiment_id: str, run_id: str | None = None, run_tab: str = "") -> str:
    """The UI's page of an experiment's runs, or of one run (run_tab: "model-metrics", "artifacts/PATH", ...),
    in the model-training workflow."""
    if run_tab and not run_id:
        raise ValueError(f"run_tab {run_tab!r} needs a run_id")
    page = f"experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "") + (f"/{run_tab}" if run_tab else "")
    return f"{base_url.rstrip('/')}/#/{page}?workflowType={TRAINING_WORKFLOW}"
