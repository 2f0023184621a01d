"""`MLflowRunLogger`: Lightning's MLFlowLogger, with an MLflow run that exists only once something is logged.

Lightning's logger creates its run when the trainer sets up (the trainer touches `logger.experiment`, and
ModelCheckpoint asks for `logger.version` to name its folder), so a resume refused on its checkpoint left a
FAILED run and `predict` (which logs nothing) a FINISHED one, each empty. Here:

- `experiment` gets (or creates) the experiment only; the run opens at the first metric, tag or artifact
  written through `run_id` (at fit start, after a checkpoint was restored). Params (`log_hyperparams`), tags
  (`set_tags`) and texts (`log_text`, the config) given before wait and go in when it opens; a process that
  never logs anything leaves no run.
- `version`, which names the checkpoint folder (`runs/<experiment id>/<version>/checkpoints`), is a fresh id
  of its own (the run id when appending to a run with `run_id`): the run id is not known that early. The run
  says where its checkpoints are in its `checkpoint_dir` tag.
- When the run opens: RUNNING runs of the experiment whose process is gone are marked KILLED
  (`mhar_lit.tracking.reap_dead_runs`), and the run is tagged with this process's host, pid and start time.
- Params are immutable in MLflow: appending to a run (`run_id`) logs a param only if absent; one that differs
  is kept as it was, with a warning.
- Only global rank zero touches the store: other ranks never construct an MLflow client (Lightning's constructs
  one on every rank, and each would open, and race to create, an sqlite store). Rank zero opens an sqlite
  store once under a file lock first (`mhar_lit.tracking.prepare_store`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import Any, Literal, Optional

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from mhar_lit.tracking import prepare_store, process_tags, reap_dead_runs

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _no_mlflow_client():
    """Lightning's constructor builds `mlflow.tracking.MlflowClient(uri)`, which opens the store: on ranks other
    than zero it gets None instead (nothing there may touch the store; Lightning's own methods are rank-zero
    only)."""
    import mlflow.tracking

    real = mlflow.tracking.MlflowClient
    mlflow.tracking.MlflowClient = lambda *args, **kwargs: None
    try:
        yield
    finally:
        mlflow.tracking.MlflowClient = real


class MLflowRunLogger(MLFlowLogger):
    """MLFlowLogger whose run opens at its first write (module docstring). Same arguments as Lightning's."""

    def __init__(
        self,
        experiment_name: str = "lightning_logs",
        run_name: Optional[str] = None,
        tracking_uri: Optional[str] = os.getenv("MLFLOW_TRACKING_URI"),
        tags: Optional[dict[str, Any]] = None,
        save_dir: Optional[str] = "./mlruns",
        log_model: Literal[True, False, "all"] = False,
        prefix: str = "",
        artifact_location: Optional[str] = None,
        run_id: Optional[str] = None,
        synchronous: Optional[bool] = None,
    ) -> None:
        args = dict(experiment_name=experiment_name, run_name=run_name, tracking_uri=tracking_uri, tags=tags,
                    save_dir=save_dir, log_model=log_model, prefix=prefix, artifact_location=artifact_location,
                    run_id=run_id, synchronous=synchronous)
        if rank_zero_only.rank == 0:
            if tracking_uri:
                prepare_store(tracking_uri)
            super().__init__(**args)
        else:
            with _no_mlflow_client():
                super().__init__(**args)
        self._folder_id = run_id or uuid.uuid4().hex
        self._pending_params: dict[str, str] = {}
        self._pending_tags: dict[str, str] = {}
        self._pending_texts: list[tuple[str, str]] = []

    # ------------------------------------------------------------------ the experiment and the run
    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The MLflow client, with the experiment resolved; no run is opened here."""
        if self._experiment_id is None:
            import mlflow

            mlflow.set_tracking_uri(self._tracking_uri)
            if self._run_id is not None:
                self._experiment_id = self._mlflow_client.get_run(self._run_id).info.experiment_id
            else:
                found = self._mlflow_client.get_experiment_by_name(self._experiment_name)
                if found is not None and found.lifecycle_stage != "deleted":
                    self._experiment_id = found.experiment_id
                else:
                    self._experiment_id = self._mlflow_client.create_experiment(
                        name=self._experiment_name, artifact_location=self._artifact_location)
        return self._mlflow_client

    @property
    def run_id(self) -> Optional[str]:
        """The run's id; opens the run (callers write to it)."""
        if rank_zero_only.rank == 0:
            self._open_run()
        return self._run_id

    @property
    def run_opened(self) -> bool:
        return self._initialized

    @property
    def version(self) -> Optional[str]:
        """The run's folder name (module docstring): stable before and after the run opens."""
        return self._folder_id if rank_zero_only.rank == 0 else None

    def _open_run(self) -> None:
        if self._initialized:
            return
        client = self.experiment
        reap_dead_runs(client, [self._experiment_id])
        tags = {**(self.tags or {}), **self._pending_tags, **process_tags()}
        if self._run_id is None:
            from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME

            from lightning.pytorch.loggers.mlflow import _get_resolve_tags

            if self._run_name is not None:
                tags[MLFLOW_RUN_NAME] = self._run_name
            run = client.create_run(experiment_id=self._experiment_id, tags=_get_resolve_tags()(tags))
            self._run_id = run.info.run_id
        else:  # appending to an earlier run: it is running again
            client.update_run(self._run_id, status="RUNNING")
            for key, value in tags.items():
                client.set_tag(self._run_id, key, value)
        self._initialized = True
        self._pending_tags = {}
        params, self._pending_params = self._pending_params, {}
        self._log_params(params)
        texts, self._pending_texts = self._pending_texts, []
        for text, name in texts:
            client.log_text(self._run_id, text, name)

    # ------------------------------------------------------------------ writes that wait for the run
    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

        flat = {key: str(value)[:250] for key, value in _flatten_dict(_convert_params(params)).items()}
        if not self._initialized:
            self._pending_params.update(flat)
            return
        self._log_params(flat)

    def _log_params(self, params: dict[str, str]) -> None:
        """Log the params the run lacks; keep (and warn about) those it already has with another value."""
        if not params:
            return
        from mlflow.entities import Param

        existing = self._mlflow_client.get_run(self._run_id).data.params
        differ = {k: (existing[k], v) for k, v in params.items() if k in existing and existing[k] != v}
        if differ:
            log.warning("MLflow params are immutable; run %s keeps its values of %s", self._run_id,
                        "; ".join(f"{k}={old!r} (this process: {new!r})" for k, (old, new) in differ.items()))
        new = [Param(key=k, value=v) for k, v in params.items() if k not in existing]
        for start in range(0, len(new), 100):  # MLflow's limit per batch
            self._mlflow_client.log_batch(run_id=self._run_id, params=new[start:start + 100],
                                          **self._log_batch_kwargs)

    @rank_zero_only
    def set_tags(self, tags: dict[str, Any]) -> None:
        if not self._initialized:
            self._pending_tags.update({k: str(v) for k, v in tags.items()})
            return
        for key, value in tags.items():
            self._mlflow_client.set_tag(self._run_id, key, str(value))

    @rank_zero_only
    def log_text(self, text: str, artifact_file: str) -> None:
        if not self._initialized:
            self._pending_texts.append((text, artifact_file))
            return
        self._mlflow_client.log_text(self._run_id, text, artifact_file)
