"""`FitSummary`: what a finished `fit` prints last, so that a run says where it went.

    fit done: run FullAttnRes-demo-20261206-2212-ab12 (MLflow id 7ed0...), 200 steps
      train/loss 2.1234   val/loss 2.2345   41,203 tokens/s
      checkpoint runs/1/69d0.../checkpoints/last.ckpt
      UI: make ui, then http://127.0.0.1:5000/#/experiments/1/runs/7ed0...
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional, TextIO

import lightning as L

from mhar_lit.tracking import local_store_path, redact_credentials


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """Where the run opens in MLflow's UI: the server's own address, or `make ui`'s for a local store."""
    if local_store_path(tracking_uri) is None and tracking_uri.startswith(("http://", "https://")):
        return redact_credentials(f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}")
    return f"make ui, then http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}"


class FitSummary(L.Callback):
    """Prints, at the end of a fit on global rank zero, the run's name and id, the last train and validation
    loss, the mean tokens/s after the first batch, the checkpoint's path and the run's address in the UI."""

    def __init__(self, out: Optional[TextIO] = None) -> None:
        self.out = out
        self._tokens = 0
        self._t0: Optional[float] = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """The clock starts at the end of the first batch (start-up, data preparation and compilation are not
        the training speed); validation pauses stay in, as in the fit's wall time."""
        if self._t0 is None:
            self._t0, self._tokens = time.perf_counter(), 0
        elif hasattr(batch, "shape") and len(batch.shape) == 2:
            self._tokens += batch[:, :-1].numel() * trainer.world_size

    def lines(self, trainer) -> list[str]:
        from lightning.pytorch.loggers import MLFlowLogger

        logger = next((lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)), None)
        opened = logger is not None and getattr(logger, "run_opened", True)
        name = getattr(logger, "_run_name", None) if logger is not None else None
        head = f"fit done: {trainer.global_step} steps"
        if opened:
            head = f"fit done: run {name or '?'} (MLflow id {logger.run_id}), {trainer.global_step} steps"
        metrics = trainer.callback_metrics
        numbers = [f"{key} {float(metrics[key]):.4f}" for key in ("train/loss", "val/loss") if key in metrics]
        elapsed = time.perf_counter() - self._t0 if self._t0 is not None else 0.0
        if self._tokens and elapsed > 0:
            numbers.append(f"{self._tokens / elapsed:,.0f} tokens/s")
        lines = [head] + (["  " + "   ".join(numbers)] if numbers else [])
        ckpt = trainer.checkpoint_callback
        path = ckpt and (ckpt.last_model_path or ckpt.best_model_path)
        if path and os.path.exists(path):
            lines.append(f"  checkpoint {path}")
        if opened:
            lines.append("  UI: " + run_url(logger._tracking_uri or "", logger.experiment_id, logger.run_id))
        return lines

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            print("\n".join(self.lines(trainer)), file=self.out or sys.stdout, flush=True)


def summary_callbacks(callbacks: list[Any]) -> list[Any]:
    """The summary unless the config brings its own."""
    return [] if any(isinstance(c, FitSummary) for c in callbacks) else [FitSummary()]
