"""Training callbacks: throughput/MFU/memory, routing monitor (entropy + heatmaps) and the step progress bar.
The checkpoint callbacks are in mhar_lit.lit.checkpoint_callbacks (re-exported here)."""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, NamedTuple, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf

from mhar_lit.lit.checkpoint_callbacks import (LogCheckpointArtifact, OneCopyCheckpoint,  # noqa: F401 (re-exported)
                                               _mlflow_logger, hard_link_checkpoint)
from mhar_lit.residual.attnres import RoutedResidual

log = logging.getLogger(__name__)


def training_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """PaLM-style estimate: 6 x (matmul parameters incl. the LM head) + 12 x L x heads x head_dim x T."""
    cfg = model.config
    matmul_params = model.num_parameters(non_embedding=True) + cfg.vocab_size * cfg.hidden_size
    return 6.0 * matmul_params + 12.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len


def lightning_step(trainer: L.Trainer) -> int:
    """The step at which Lightning logs the `self.log` metrics of the batch that just finished (its loss, lr,
    grad norm): the optimizer steps taken before that batch. In on_train_batch_end after an optimizer step,
    trainer.global_step already counts that step, so it is one more; metrics logged at it would sit one step
    to the right of the loss of the same batch in MLflow's charts."""
    return max(trainer.global_step - 1, 0)


class SpeedMonitor(L.Callback):
    """Logs train/tokens_per_s, train/mfu (against `peak_tflops`, e.g. 989 for H100/H200 dense bf16) and
    train/peak_mem_gb every `every_n_steps` optimizer steps; the first `skip_steps` steps are warm-up. Values
    are logged at the step of the window's last batch as Lightning numbers it (`lightning_step`), next to that
    batch's loss.

    The pause for a validation pass inside a window is left out, from validation start until training resumes
    (so a checkpoint saved at validation end is left out too; a window that held one used to read ~30% low),
    and the values go straight to the loggers once per window: logged through `LightningModule.log`, the last
    value was re-emitted at every `log_every_n_steps` flush, so the history held each window twice."""

    def __init__(self, every_n_steps: int = 10, peak_tflops: Optional[float] = None, skip_steps: int = 2) -> None:
        self.every_n_steps, self.peak_tflops, self.skip_steps = every_n_steps, peak_tflops, skip_steps
        self._t0: Optional[float] = None
        self._val_t0: Optional[float] = None
        self._tokens = 0
        self._last_logged = -1

    def _sync(self, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step < self.skip_steps:
            return
        if self._t0 is None:
            self._sync(pl_module)
            self._t0, self._tokens = time.perf_counter(), 0
            return
        self._tokens += batch[:, :-1].numel() * trainer.world_size
        # With gradient accumulation several batches share one global step: log once per step.
        if step % self.every_n_steps or step == self._last_logged:
            return
        self._last_logged = step
        self._sync(pl_module)
        elapsed = time.perf_counter() - self._t0
        tokens_per_s = self._tokens / elapsed
        metrics = {"train/tokens_per_s": tokens_per_s}
        if self.peak_tflops:
            flops = training_flops_per_token(pl_module.model, batch.shape[1] - 1) * tokens_per_s
            metrics["train/mfu"] = flops / (self.peak_tflops * 1e12 * trainer.world_size)
        if pl_module.device.type == "cuda":
            metrics["train/peak_mem_gb"] = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=lightning_step(trainer))
        self._t0, self._tokens = time.perf_counter(), 0

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._t0 is not None and self._val_t0 is None and not trainer.sanity_checking:
            self._sync(pl_module)
            self._val_t0 = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # The pause ends when training resumes, not at on_validation_end: callbacks that run after this one at
        # validation end (ModelCheckpoint, which Lightning moves last, saves there) belong to the pause too.
        if self._val_t0 is not None and self._t0 is not None:
            self._sync(pl_module)
            self._t0 += time.perf_counter() - self._val_t0  # the window's clock skips the pause
        self._val_t0 = None


class SiteRouting(NamedTuple):
    """Routing statistics of one site over the tokens of a batch, per head (H = routing heads, N = sources)."""

    token_entropy_H: torch.Tensor  # mean over tokens of the per-token entropy / log N (1 = uniform; N >= 2)
    logit_spread_H: torch.Tensor  # mean over tokens of max_n - min_n of the head's logits
    mean_weights_NH: torch.Tensor  # token-averaged routing weights


def site_routing(sources_NBTD: torch.Tensor, query_D: torch.Tensor, key_norm_D: torch.Tensor, heads: int,
                 eps: float) -> SiteRouting:
    """Per-token routing statistics of one site from its sources with the reference math (mhar_lit.routing).

    The entropy is taken per token, then averaged: the entropy of token-averaged weights hides per-token
    sharpness (tokens that each pick one different source average to uniform). `query_D` is the query the router
    is given (`RoutedResidual.effective_query()`: logit_scale applied)."""
    from mhar_lit.routing import routing_logits

    logits_NBTH = routing_logits(sources_NBTD, query_D, key_norm_D, heads, eps)
    n = logits_NBTH.shape[0]
    log_w = logits_NBTH.log_softmax(dim=0)
    weights = log_w.exp()
    entropy_BTH = -(weights * log_w).sum(0)
    token_entropy = entropy_BTH.mean(dim=(0, 1)) / math.log(n) if n > 1 else entropy_BTH.new_zeros(heads)
    spread = (logits_NBTH.amax(0) - logits_NBTH.amin(0)).mean(dim=(0, 1))
    return SiteRouting(token_entropy.float().cpu(), spread.float().cpu(), weights.mean(dim=(1, 2)).float().cpu())


def collect_routing(pl_module: L.LightningModule, input_ids: torch.Tensor) -> dict[int, SiteRouting]:
    """{site: SiteRouting} of one no-grad forward pass, from the sources every routing site exposes
    (`RoutedResidual.source_observer`)."""
    residual = pl_module.model.residual
    query_SD, key_norm_SD = residual.effective_query().detach(), residual.key_norm.detach()
    collected: dict[int, SiteRouting] = {}

    def observe(site: int, sources_NBTD: torch.Tensor) -> None:
        collected[site] = site_routing(sources_NBTD, query_SD[site], key_norm_SD[site], residual.heads, residual.eps)

    previous, residual.source_observer = residual.source_observer, observe
    try:
        with torch.no_grad():
            pl_module.model(input_ids)
        return collected
    finally:
        residual.source_observer = previous


def routing_metrics(collected: dict[int, SiteRouting]) -> dict[str, float]:
    """The few scalars a run page shows (per-head detail goes to the heatmaps): per site the head-mean
    per-token entropy, the overall mean, and the overall mean logit spread; sites with one source (entropy
    identically 0) are left out."""
    routed = {site: r for site, r in sorted(collected.items()) if r.mean_weights_NH.shape[0] > 1}
    metrics = {f"routing/entropy_site{site:02d}": r.token_entropy_H.mean().item() for site, r in routed.items()}
    if routed:
        metrics["routing/entropy"] = torch.stack([r.token_entropy_H for r in routed.values()]).mean().item()
        metrics["routing/logit_spread"] = torch.stack([r.logit_spread_H for r in routed.values()]).mean().item()
    return metrics


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def routing_heatmap(recorded: dict[int, torch.Tensor], title: str):
    """One matplotlib figure: a (sites x sources) heatmap per head of the token-averaged routing weights."""
    plt = _plt()
    sites = sorted(recorded)
    max_sources = max(recorded[s].shape[0] for s in sites)
    heads = recorded[sites[0]].shape[1]
    grid = torch.full((heads, len(sites), max_sources), float("nan"))
    for row, site in enumerate(sites):
        w = recorded[site]
        grid[:, row, : w.shape[0]] = w.T
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False, layout="constrained")
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= heads:
            ax.axis("off")
            continue
        image = ax.imshow(grid[h].numpy(), vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xlabel("source")
        ax.set_ylabel("site")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="mean routing weight")
    fig.suptitle(title, fontsize=10)
    return fig


def entropy_heatmap(collected: dict[int, SiteRouting], title: str):
    """One matplotlib figure: (sites x heads) mean per-token routing entropy / log N (1 = uniform); sites with
    one source are blank."""
    plt = _plt()
    sites = sorted(collected)
    heads = collected[sites[0]].token_entropy_H.shape[0]
    grid = torch.full((len(sites), heads), float("nan"))
    for row, site in enumerate(sites):
        if collected[site].mean_weights_NH.shape[0] > 1:
            grid[row] = collected[site].token_entropy_H
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * heads, 0.8 + 0.22 * len(sites)), layout="constrained")
    image = ax.imshow(grid.numpy(), vmin=0.0, vmax=1.0, cmap="magma", aspect="auto", interpolation="nearest")
    ax.set_xlabel("head")
    ax.set_ylabel("site")
    ax.set_xticks(range(heads))
    fig.colorbar(image, ax=ax, shrink=0.8, label="per-token entropy / log N")
    ax.set_title(title, fontsize=9)
    return fig


class RoutingMonitor(L.Callback):
    """Every `every_n_steps` optimizer steps: routing diagnostics and the summed learning rate.

    Metrics (a few scalars, so the run page stays readable): `routing/entropy_site{s:02d}` (per site, the
    head-mean of the mean per-token routing entropy / log N; 1 = uniform mixing), `routing/entropy` (their
    mean), `routing/logit_spread` (mean over sites, heads and tokens of max - min of a head's logits over the
    sources), `routing/monitor_ms`, and `train/lr_sum`: the sum of the lr used by every optimizer step so far
    (with a strategy `routing_lr_scale` != 1 also `train/routing_lr_sum`, the routing group's). The sums are part of
    the callback's checkpoint state, so a resumed run continues them.

    Figures (per-head detail): `routing/heatmap_step{N:07d}.png` (token-averaged weights, sites x sources per
    head) and `routing/entropy_step{N:07d}.png` (per-token entropy, sites x heads), N the step at which the
    metrics of the same pass are logged (Lightning's step of the batch, `lightning_step`, where that batch's
    loss is); at the end of training `..._final.png`.

    The routing statistics come from one extra no-grad forward on the first `max_sequences` sequences of the
    current batch; strategies without depth routing log only the lr sums.
    """

    def __init__(self, every_n_steps: int = 100, max_sequences: int = 2, log_heatmaps: bool = True) -> None:
        self.every_n_steps, self.max_sequences, self.log_heatmaps = every_n_steps, max_sequences, log_heatmaps
        self._last_logged = -1
        self.lr_sum = 0.0
        self.routing_lr_sum = 0.0
        self._restored = False

    def state_dict(self) -> dict[str, Any]:
        return {"lr_sum": self.lr_sum, "routing_lr_sum": self.routing_lr_sum}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.lr_sum = float(state_dict.get("lr_sum", 0.0))
        self.routing_lr_sum = float(state_dict.get("routing_lr_sum", 0.0))
        self._restored = True

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step > 0 and not self._restored:
            log.warning("the checkpoint holds no summed lr (written before train/lr_sum existed): train/lr_sum "
                        "counts from step %d", trainer.global_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lr_sum += float(optimizer.param_groups[0]["lr"])
        self.routing_lr_sum += float(optimizer.param_groups[-1]["lr"])

    def _lr_metrics(self, pl_module) -> dict[str, float]:
        metrics = {"train/lr_sum": self.lr_sum}
        if pl_module.model.residual.routing_lr_scale != 1.0:
            metrics["train/routing_lr_sum"] = self.routing_lr_sum  # the queries' group is the last one
        return metrics

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or step == self._last_logged or not trainer.is_global_zero:
            return
        self._last_logged = step
        routed = isinstance(pl_module.model.residual, RoutedResidual) and not self._sharded(trainer)
        if routed:
            self.log_routing(trainer, pl_module, batch[: self.max_sequences, :-1])
        else:
            _log_metrics(trainer, self._lr_metrics(pl_module))

    def _sharded(self, trainer) -> bool:
        """Under FSDP a rank-0 side forward would read parameter shards and desynchronise collectives."""
        from mhar_lit.lit.routing_backend import is_sharded

        if is_sharded(trainer) and not getattr(self, "_warned", False):
            log.warning("routing monitor disabled under %s: run `python -m mhar_lit probe` on a checkpoint",
                        type(trainer.strategy).__name__)
            self._warned = True
        return is_sharded(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        batch = getattr(self, "_last_batch", None)
        if batch is None or not trainer.is_global_zero:
            return
        if isinstance(pl_module.model.residual, RoutedResidual) and not self._sharded(trainer):
            self.log_routing(trainer, pl_module, batch, final=True)
        else:
            _log_metrics(trainer, self._lr_metrics(pl_module))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._last_batch = batch[: self.max_sequences, :-1]

    def log_routing(self, trainer, pl_module, input_ids, final: bool = False) -> None:
        start = time.perf_counter()
        was_training = pl_module.training
        pl_module.eval()
        try:
            collected = collect_routing(pl_module, input_ids)
        finally:
            pl_module.train(was_training)
        metrics = {**routing_metrics(collected), **self._lr_metrics(pl_module)}
        metrics["routing/monitor_ms"] = (time.perf_counter() - start) * 1e3
        _log_metrics(trainer, metrics)
        if self.log_heatmaps and collected:
            name = "final" if final else f"step{lightning_step(trainer):07d}"
            weights = {site: r.mean_weights_NH for site, r in collected.items()}
            log_figure(trainer, routing_heatmap(weights, f"routing weights, {name}"), f"routing/heatmap_{name}.png")
            log_figure(trainer, entropy_heatmap(collected, f"per-token routing entropy, {name}"),
                       f"routing/entropy_{name}.png")


def _log_metrics(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=lightning_step(trainer))


def log_figure(trainer: L.Trainer, figure: Any, artifact_file: str) -> None:
    """Log a matplotlib figure to MLflow if an MLflow logger is attached, else save it under the log dir."""
    import matplotlib.pyplot as plt

    try:
        mlflow = _mlflow_logger(trainer)
        if mlflow is not None:
            mlflow.experiment.log_figure(mlflow.run_id, figure, artifact_file)
            return
        out = os.path.join(trainer.log_dir or trainer.default_root_dir, artifact_file)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        figure.savefig(out, dpi=100)
    finally:
        plt.close(figure)


class StepProgressBar(TQDMProgressBar):
    """With trainer.max_steps set, the training bar counts optimizer steps against max_steps (a resumed run
    starts at its checkpoint's step) and shows the tokens per second since the bar started; without it,
    Lightning's per-epoch bar. Lightning's own bar counts batches of an epoch of an endless stream, which read
    "Epoch 0/-2 ... 200/200" and "40/9" after a resume."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self._t0: Optional[float] = None
        self._tokens = 0

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        if trainer.max_steps is None or trainer.max_steps < 0:
            return
        bar = self.train_progress_bar
        bar.total = convert_inf(trainer.max_steps)
        bar.initial = bar.n = trainer.global_step  # tqdm's rate counts from `initial`: a resume starts there
        bar.set_description("step")
        if self._t0 is None:
            self._t0, self._tokens = time.perf_counter(), 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.max_steps is None or trainer.max_steps < 0:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if isinstance(batch, torch.Tensor) and batch.dim() == 2:  # token ids [B, T+1]: T predicted per row
            self._tokens += batch[:, :-1].numel() * trainer.world_size
        step, bar = trainer.global_step, self.train_progress_bar
        if bar is not None and self._should_update(step, trainer.max_steps) and step != bar.n:
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # set_postfix refreshes the bar

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's run version: noise on a terminal, the run name says it
        elapsed = time.perf_counter() - self._t0 if self._t0 is not None else 0.0
        if self._tokens and elapsed > 0:
            metrics["tok/s"] = f"{self._tokens / elapsed:,.0f}"
        return metrics
