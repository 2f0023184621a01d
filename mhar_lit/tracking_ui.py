"""Make MLflow's web UI open a training experiment on its runs list instead of its GenAI pages.

MLflow 3.17's UI decides an experiment's landing page by its experiment kind: GenAI development opens the
"Overview" of traces (empty for a training run), model development opens "Runs". The kind is the
experiment tag `mlflow.experimentKind` (`custom_model_development` or `genai_development`, the values the
UI's own "experiment type" selector writes); the 3.17.2 web bundle also lets a per-browser choice, the
sidebar's workflow switch (`?workflowType=machine_learning` in a URL), override it. Tagging the experiment
is what a store can carry; `runs_page_url` gives the link that opens the runs list in any browser.
"""

from __future__ import annotations

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
TRAINING_WORKFLOW = "machine_learning"


def mark_training_experiment(client, experiment_id: str) -> bool:
    """Tag the experiment as model development (idempotent). `client` is an `mlflow.MlflowClient` (what
    Lightning's `MLFlowLogger.experiment` is). Returns True when the tag was written, False when it was
    already there, so a resumed or repeated run does not rewrite it."""
    experiment = client.get_experiment(experiment_id)
    if experiment is None:
        raise ValueError(f"no MLflow experiment with id {experiment_id!r} in {client.tracking_uri}")
    if experiment.tags.get(EXPERIMENT_KIND_TAG) == TRAINING_KIND:
        return False
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    return True


def runs_page_url(base_url: str, experiment_id: str, run_id: str | None = None) -> str:
    """The UI's page of an experiment's runs (or of one run), in the model-training workflow."""
    page = f"experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "")
    return f"{base_url.rstrip('/')}/#/{page}?workflowType={TRAINING_WORKFLOW}"
