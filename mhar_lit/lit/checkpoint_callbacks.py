"""The checkpoint callbacks: the final checkpoint (one copy: last.ckpt a hard link of the top-k file, pointed to
by the MLflow run) and what a kill right after a save must not cost (a validation, a logged step, a run).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

log = logging.getLogger(__name__)


def _mlflow_logger(trainer: L.Trainer):
    from lightning.pytorch.loggers import MLFlowLogger

    return next((lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)), None)


class LogCheckpointArtifact(L.Callback):
    """The run's final checkpoint: saved at the end of training, pointed to by the MLflow run, linked on resume.

    One copy of the final checkpoint by default: the file in the run's checkpoint folder (`last.ckpt`, which
    `OneCopyCheckpoint` makes a hard link of the top-k file of the same step), named in the run's tags.
    Uploading it to MLflow as well is opt-in (`upload=True`): a third copy in the artifact store, useful only
    when the artifact store is the one place the run's files outlive the machine.

    - At train end, `last.ckpt` is written again if the last save was at an earlier step (ModelCheckpoint saves
      at validations only, so max_steps off the validation interval, or a max_time stop, lost the last steps).
    - The run is tagged with its checkpoint folder (`checkpoint_dir`) when training starts, so a killed run
      still points at its last.ckpt, and with the final checkpoint's path (`checkpoint_path`) at the end of fit.
    - With `upload=True` the final checkpoint is uploaded as an artifact at the end of fit: only single files up
      to `max_bytes` (a sharded checkpoint directory, or an 8B checkpoint with optimizer states, would
      duplicate tens of GB into the artifact store).
    - A resumed fit is a new MLflow run tagged `resumed_from_run` (the run that wrote the checkpoint, kept in
      this callback's checkpoint state) and `resumed_from_checkpoint`.
    """

    def __init__(self, upload: bool = False, max_bytes: int = 2 * 2**30) -> None:
        self.upload = upload
        self.max_bytes = max_bytes
        self._saved_step: Optional[int] = None  # global step of the newest checkpoint written in this fit
        self._run_id: Optional[str] = None
        self._resumed_from: Optional[str] = None

    def state_dict(self) -> dict[str, Any]:
        return {"mlflow_run_id": self._run_id}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed_from = state_dict.get("mlflow_run_id")

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._unlogged = checkpoint.get(UNLOGGED_STEP_METRICS)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Tag the run here, not only at train start: a fit resumed from its final checkpoint (killed after the
        last save) ends before training starts, and without the tags its run would not join its parent."""
        self._saved_step = None
        self._tagged = False
        if trainer.ckpt_path:
            self._tag(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._tag(trainer)
        unlogged, self._unlogged = getattr(self, "_unlogged", None), None
        if unlogged and trainer.is_global_zero:  # the parent may have died between its save and this log
            for logger in trainer.loggers:
                logger.log_metrics(unlogged["metrics"], step=unlogged["step"])

    def _tag(self, trainer: L.Trainer) -> None:
        if getattr(self, "_tagged", False):
            return
        self._tagged = True
        mlflow = _mlflow_logger(trainer)
        self._run_id = mlflow.run_id if mlflow is not None and trainer.is_global_zero else None
        ckpt = trainer.checkpoint_callback
        if mlflow is not None and trainer.is_global_zero and ckpt is not None and ckpt.dirpath:
            # known from the start, so that a killed run still says where its last.ckpt is
            mlflow.experiment.set_tag(mlflow.run_id, "checkpoint_dir", os.path.abspath(ckpt.dirpath))
        if trainer.ckpt_path and mlflow is not None and trainer.is_global_zero:
            mlflow.experiment.set_tag(mlflow.run_id, "resumed_from_checkpoint", os.path.abspath(trainer.ckpt_path))
            if self._resumed_from:
                mlflow.experiment.set_tag(mlflow.run_id, "resumed_from_run", self._resumed_from)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._saved_step = trainer.global_step

    @staticmethod
    def _last_path(trainer: L.Trainer, ckpt: Any) -> str:
        """ModelCheckpoint's own last file of this fit; else its name for one, versioned as ModelCheckpoint does
        (last-v1.ckpt, ...) so that a folder shared with an earlier run keeps that run's last.ckpt."""
        if ckpt.last_model_path and os.path.dirname(os.path.abspath(ckpt.last_model_path)) == os.path.abspath(ckpt.dirpath):
            return ckpt.last_model_path
        path, version = ckpt.format_checkpoint_name({}, ckpt.CHECKPOINT_NAME_LAST), 1
        while ckpt.file_exists(path, trainer):
            path = ckpt.format_checkpoint_name({}, ckpt.CHECKPOINT_NAME_LAST, ver=version)
            version += 1
        return path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ckpt = trainer.checkpoint_callback
        if ckpt is None or not ckpt.save_last or ckpt.dirpath is None:
            return
        if trainer.global_step == 0 or self._saved_step == trainer.global_step:
            return
        path = self._last_path(trainer, ckpt)
        if os.path.islink(path):  # save_last="link": replace the link, do not write through it into a top-k file
            if trainer.is_global_zero:
                os.remove(path)
            trainer.strategy.barrier("mhar_lit_last_link")
        trainer.save_checkpoint(path, weights_only=False)  # every rank calls it, as a sharded save needs
        ckpt.last_model_path = path
        # ModelCheckpoint (run after this callback) would otherwise save once more if it never saved in this fit
        for name, value in (("_last_checkpoint_saved", path), ("_last_global_step_saved", trainer.global_step)):
            if hasattr(ckpt, name):
                setattr(ckpt, name, value)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ckpt, mlflow = trainer.checkpoint_callback, _mlflow_logger(trainer)
        path = ckpt and (ckpt.last_model_path or ckpt.best_model_path)
        if mlflow is None or not path or not os.path.exists(path) or not trainer.is_global_zero:
            return
        mlflow.experiment.set_tag(mlflow.run_id, "checkpoint_path", os.path.abspath(path))
        if not self.upload:
            return
        if os.path.isfile(path) and os.path.getsize(path) <= self.max_bytes:
            mlflow.experiment.log_artifact(mlflow.run_id, path, artifact_path="checkpoints")
        else:
            log.warning("checkpoint %s not copied to MLflow (a directory or > %d bytes); its path is in the run's "
                        "'checkpoint_path' tag", path, self.max_bytes)


UNLOGGED_STEP_METRICS = "mhar_lit_unlogged_step_metrics"


def _validation_follows(trainer: L.Trainer) -> bool:
    """Whether Lightning validates right after the batch that just ended (its own rule, asked of its loop)."""
    loop = trainer.fit_loop.epoch_loop
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    return fetcher is not None and bool(loop._should_check_val_fx(fetcher))


def _metrics_about_to_be_logged(trainer: L.Trainer) -> Optional[dict[str, Any]]:
    """{"step", "metrics"}: what Lightning logs right after on_train_batch_end for this step (None if nothing)."""
    connector = trainer._logger_connector
    if not connector.should_update_logs:
        return None
    metrics = {k: float(v) for k, v in connector.metrics["log"].items() if k != "step"}
    return {"step": trainer.fit_loop.epoch_loop._batches_that_stepped, "metrics": metrics} if metrics else None


def flush_async_metrics(trainer: L.Trainer) -> None:
    """Wait for the MLflow loggers' asynchronous writes (synchronous: false) to reach the store."""
    if _mlflow_logger(trainer) is not None and trainer.is_global_zero:
        import mlflow

        mlflow.flush_async_logging()


class OneCopyCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose `last.ckpt` is a hard link of the top-k file saved at the same step (with
    `save_last` true or "link"): one file on disk, not two. A hard link is a whole file, as `save_last=True`
    promises, and, unlike Lightning's symbolic link for "link", never dangling (a top-k file removed later
    leaves last.ckpt whole; a kill between the top-k save and the link leaves the previous last.ckpt). The link
    gets its own sha256 sidecar (AtomicCheckpointIO's format, written so that a crash at any point leaves a pair
    that verifies). Where hard links fail (another file system, a directory checkpoint) a symbolic link is made.

    With no top-k file of the current step (a monitored metric that did not improve), last.ckpt is written as a
    file of its own: Lightning's "link" would point it at the newest top-k file, of an earlier step."""

    # -------------------------------------------------------------- what a kill after a save leaves
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and trainer.is_global_zero and self.dirpath and "://" not in str(self.dirpath):
            from mhar_lit.run_folder import remove_stale_temp_files_near

            remove_stale_temp_files_near(self.dirpath)  # a killed save of a run restarted instead of resumed

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """A step save due at a step that validates is made after that validation (on_validation_end), not
        before it: Lightning, resuming from a save made before the validation, counts that validation as done,
        and the run's history (val/loss, the tail-mean) would lack it for good. A save made here, before
        Lightning logs the step's metrics, records them in the checkpoint (`on_save_checkpoint`) so that the
        resumed run logs what a kill right after the save lost."""
        if self._step_save_due(trainer) and _validation_follows(trainer) and hasattr(
                self, "_defer_save_until_validation"):
            self._defer_save_until_validation = True  # ModelCheckpoint.on_validation_end saves it
            return
        self._before_step_log = True
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            self._before_step_log = False

    def _step_save_due(self, trainer: L.Trainer) -> bool:
        every = getattr(self, "_every_n_train_steps", 0)
        return every >= 1 and trainer.global_step % every == 0

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> Any:
        if getattr(self, "_before_step_log", False):
            checkpoint[UNLOGGED_STEP_METRICS] = _metrics_about_to_be_logged(trainer)
        return super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        flush_async_metrics(trainer)  # what the run logged so far is in the store before the checkpoint exists
        super()._save_checkpoint(trainer, filepath)

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict) -> None:
        if not self.save_last:
            return
        wanted = self.save_last
        same_step = bool(self._last_checkpoint_saved) and self._last_global_step_saved == trainer.global_step
        self.save_last = "link" if same_step and self.save_top_k != 0 else True
        try:
            super()._save_last_checkpoint(trainer, monitor_candidates)
        finally:
            self.save_last = wanted

    @staticmethod
    def _link_checkpoint(trainer: L.Trainer, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            try:
                hard_link_checkpoint(filepath, linkpath)
            except OSError as err:
                log.warning("last checkpoint: no hard link %s -> %s (%s); a symbolic link instead", linkpath,
                            filepath, err)
                if os.path.islink(linkpath) or os.path.isfile(linkpath):
                    os.remove(linkpath)
                os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), linkpath)
        trainer.strategy.barrier()


def hard_link_checkpoint(target: str, link: str) -> None:
    """Make `link` a hard link of the checkpoint file `target`, replacing what was there atomically, with a
    sidecar that accepts the old and new digests while the swap happens and then only the new one."""
    import time
    from pathlib import Path

    from mhar_lit.lit.checkpoint_io import _write_sidecar, read_digests, sidecar_path

    if os.path.isdir(target):
        raise IsADirectoryError(target)
    dest = Path(link)
    if dest.is_symlink():  # its sidecar would resolve to the target's
        dest.unlink()
    digests = read_digests(target)
    old = (read_digests(dest) or []) if dest.exists() else []
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    os.link(target, tmp)
    try:
        if digests is not None:
            _write_sidecar(dest, digests + [d for d in old if d not in digests])
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    if digests is not None:
        _write_sidecar(dest, digests)
    elif sidecar_path(dest).exists():
        sidecar_path(dest).unlink()
