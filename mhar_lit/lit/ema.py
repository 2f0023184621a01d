"""Exponential moving average of the weights as a Lightning callback (docs/method.md H.2: beta = 0.999, EMA evaluated).

    shadow <- decay * shadow + (1 - decay) * param        after every optimizer step, in fp32

The shadow is fp32 whatever the parameter dtype: under `bf16-true` a bf16 shadow would lose most
updates, since (1 - 0.999) * (param - shadow) is far below bf16 resolution. It starts as a copy of the
weights when training starts (for mid-training: the converted pretrained weights).

With `evaluate_with_ema`, validation and test run on the shadow (cast to the parameter dtype) and the
training weights are put back afterwards. With `save_ema`, checkpoints carry the shadow in the
callback's state and resuming restores it.

Sharding: parameters are tracked as the local tensors this rank holds (under FSDP with
use_orig_params, Lightning's default, each rank's slice of every parameter), so the EMA costs 4 bytes
per parameter divided by the number of shards. Lightning saves only rank 0's callback state, so under
FSDP every rank's shadow is gathered to rank 0 over a CPU (gloo) group at save time and each rank takes
its own slice back on resume; resuming needs the same world size (otherwise the EMA restarts from the
weights, with a warning). Export the EMA model with `with ema.swapped(module): save_pretrained(...)`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor

log = logging.getLogger(__name__)


class WeightEMA(L.Callback):
    """fp32 EMA of the trainable parameters; swapped in for validation/test; saved in checkpoints.

    Args:
        decay: EMA coefficient beta (0.999 in the 8B recipe).
        evaluate_with_ema: run validation and test with the EMA weights.
        save_ema: store the shadow in checkpoints (restored on resume).
        start_step: optimizer steps before which the shadow just tracks the weights (0: average from the start).
    """

    def __init__(self, decay: float = 0.999, evaluate_with_ema: bool = True, save_ema: bool = True,
                 start_step: int = 0) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay, self.evaluate_with_ema, self.save_ema, self.start_step = decay, evaluate_with_ema, save_ema, start_step
        self.shadow: Optional[dict[str, Tensor]] = None
        self.num_updates = 0
        self._last_step: Optional[int] = None
        self._pending: Optional[dict[str, Any]] = None  # state loaded from a checkpoint, adopted at train start
        self._backup: Optional[dict[str, Tensor]] = None
        self._rank, self._world_size, self._gather_group = 0, 1, None

    # ------------------------------------------------------------------ core math (no trainer needed)
    @staticmethod
    def tracked(module: torch.nn.Module) -> dict[str, Tensor]:
        return {name: p for name, p in module.named_parameters() if p.requires_grad}

    def init_from(self, module: torch.nn.Module) -> None:
        self.shadow = {name: p.detach().float().clone() for name, p in self.tracked(module).items()}
        self.num_updates = 0

    @torch.no_grad()
    def update(self, module: torch.nn.Module, step: Optional[int] = None) -> None:
        """One EMA step from the module's current weights (before `start_step`: a plain copy)."""
        if self.shadow is None:
            self.init_from(module)
            return
        params = self.tracked(module)
        shadows = [self.shadow[name] for name in params]
        values = [p.detach().float() for p in params.values()]
        weight = 1.0 if step is not None and step < self.start_step else 1.0 - self.decay
        torch._foreach_lerp_(shadows, values, weight)  # s + w * (p - s) == decay * s + (1 - decay) * p
        self.num_updates += 1

    @contextlib.contextmanager
    def swapped(self, module: torch.nn.Module) -> Iterator[None]:
        """Temporarily load the EMA weights into `module` (e.g. to evaluate or export them)."""
        self.swap_in(module)
        try:
            yield
        finally:
            self.swap_out(module)

    @torch.no_grad()
    def swap_in(self, module: torch.nn.Module) -> None:
        if self.shadow is None or self._backup is not None:
            return
        params = self.tracked(module)
        self._backup = {name: p.detach().clone() for name, p in params.items()}
        for name, p in params.items():
            p.copy_(self.shadow[name])

    @torch.no_grad()
    def swap_out(self, module: torch.nn.Module) -> None:
        if self._backup is None:
            return
        for name, p in self.tracked(module).items():
            p.copy_(self._backup[name])
        self._backup = None

    # ------------------------------------------------------------------ Lightning hooks
    def _ensure_shadow(self, pl_module: L.LightningModule) -> None:
        if self._pending is not None:
            self._adopt(pl_module, self._pending)
            self._pending = None
        elif self.shadow is None:
            self.init_from(pl_module)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._rank, self._world_size = trainer.global_rank, trainer.world_size
        if self._world_size > 1 and _is_sharded(trainer.strategy) and self._gather_group is None:
            import torch.distributed as dist

            # A CPU group: gathering the shadow over NCCL would stage every shard on rank 0's GPU.
            self._gather_group = dist.new_group(backend="gloo")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._ensure_shadow(pl_module)
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # global_step only advances on real optimizer steps (not on accumulation micro-batches).
        if trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            self.update(pl_module, step=trainer.global_step - 1)

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.evaluate_with_ema:
            self._ensure_shadow(pl_module)
            self.swap_in(pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self.swap_out(pl_module)

    def on_test_start(self, trainer, pl_module) -> None:
        self.on_validation_start(trainer, pl_module)

    def on_test_end(self, trainer, pl_module) -> None:
        self.swap_out(pl_module)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        # Checkpoints hold the training weights even if a save happens mid-validation (EMA swapped in).
        if self._backup is not None:
            state = checkpoint.get("state_dict", {})
            for name, value in self._backup.items():
                if name in state:
                    state[name] = value.to(state[name].device)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"decay": self.decay, "num_updates": self.num_updates}
        if not self.save_ema or self.shadow is None:
            return state
        local = {name: t.detach().cpu().clone() for name, t in self.shadow.items()}
        if self._gather_group is None:
            state["shadow"] = local
            return state
        import torch.distributed as dist

        shards = [None] * self._world_size if self._rank == 0 else None
        dist.gather_object(local, shards, dst=0, group=self._gather_group)  # collective: every rank saves
        state.update(sharded=True, world_size=self._world_size, shards=shards)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict if ("shadow" in state_dict or state_dict.get("shards")) else None
        if self._pending is None:
            log.warning("WeightEMA: the checkpoint has no EMA shadow; the EMA restarts from the current weights")

    def _adopt(self, pl_module: L.LightningModule, state: dict[str, Any]) -> None:
        saved = self._saved_shadow(state)
        params = self.tracked(pl_module)
        if saved is None or set(params) != set(saved) or any(saved[n].shape != p.shape for n, p in params.items()):
            log.warning("WeightEMA: the saved shadow does not match this model's (local) parameters; the EMA "
                        "restarts from the current weights")
            self.init_from(pl_module)
            return
        self.shadow = {n: saved[n].to(device=params[n].device, dtype=torch.float32).clone() for n in params}
        self.num_updates = int(state.get("num_updates", 0))

    def _saved_shadow(self, state: dict[str, Any]) -> Optional[dict[str, Tensor]]:
        if not state.get("sharded"):
            return state["shadow"]
        if state.get("world_size") != self._world_size:
            log.warning("WeightEMA: checkpoint EMA was sharded over %s ranks, this run has %s",
                        state.get("world_size"), self._world_size)
            return None
        return state["shards"][self._rank]


def _is_sharded(strategy: Any) -> bool:
    """Strategies whose ranks hold different slices of the parameters (FSDP, model parallel)."""
    return type(strategy).__name__ in ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")
