"""MLflow's web UI for training runs: links that open the runs list.

MLflow 3.17 has two workflows, GenAI and model training. In GenAI an experiment opens on an "Overview" of
traces, empty for a training run ("No data available"); in model training it opens on its runs list.
- The experiment tag `mlflow.experimentKind` (`custom_model_development`) does NOT set the landing page in the
  3.17.2 web UI (checked in headless chromium, 2026-12-06: a tagged experiment still opened on the GenAI
  overview), so the package does not write it: the UI's bundle derives the kind from the browser's
  workflow choice instead, the sidebar's GenAI / Model training switch, kept in the browser's local storage
  (`mlflow.workflowType_v1`, GenAI by default) and overridden by `?workflowType=` in a page's URL.
- So what opens the runs list is a link with `?workflowType=machine_learning` (`runs_page_url`), or one
  click on "Model training", which the browser remembers (docs/training.md, Watching runs).
"""

from __future__ import annotations

TRAINING_WORKFLOW = "machine_learning"


def runs_page_url(base_url: str, experiment_id: str, run_id: str | None = None, run_tab: str = "") -> str:
    """The UI's page of an experiment's runs, or of one run (run_tab: "model-metrics", "artifacts/PATH", ...),
    in the model-training workflow."""
    if run_tab and not run_id:
        raise ValueError(f"run_tab {run_tab!r} needs a run_id")
    page = f"experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "") + (f"/{run_tab}" if run_tab else "")
    return f"{base_url.rstrip('/')}/#/{page}?workflowType={TRAINING_WORKFLOW}"
