"""LightningModule: the decoder LM with a residual strategy, the paper's optimiser and schedule, metrics.

Recipe defaults follow docs/method.md H.1: AdamW (0.9, 0.95), eps 1e-8, weight decay 0.1 on every parameter,
linear warmup then cosine decay to `min_lr_ratio` x peak, gradient clipping at global norm 1.0.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import MeanMetric

# the checkpoint reader lives in mhar_lit.checkpoint (no Lightning import); its names stay importable here
from mhar_lit.checkpoint import check_checkpoint_file, model_from_checkpoint  # noqa: F401
from mhar_lit.config import ModelConfig
from mhar_lit.models.decoder import DecoderLM, RMSNorm
from mhar_lit.errors import UserError
from mhar_lit.lit.loss import next_token_loss
from mhar_lit.residual.base import ResidualStrategy
from mhar_lit.residual.standard import StandardResidual


def lr_factor(step: int, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based): linear warmup, cosine to the floor."""
    if step < warmup_steps:
        # docs/method.md H.1 warms up "from 0"; we start at peak/W so the first update is not wasted, i.e. the ramp is
        # shifted by one step (peak reached at step W-1 instead of W). The cosine part is exactly H.1's.
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _check_training_settings(**settings: Any) -> None:
    """Refuse settings that would train silently wrong (a negative lr from min_lr_ratio < 0, an lr of 0, a tail
    mean over every validation from tail_k 0), before anything runs; each error names the model.* key."""
    rules = {
        "lr": (lambda v: v > 0, "> 0"),
        "betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two values in [0, 1)"),
        "eps": (lambda v: v > 0, "> 0"),
        "weight_decay": (lambda v: v >= 0, ">= 0"),
        "warmup_steps": (lambda v: v >= 0, ">= 0"),
        "decay_steps": (lambda v: v is None or v >= 0, ">= 0 (0 or null: trainer.max_steps)"),
        "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
        "grad_clip": (lambda v: v >= 0, ">= 0 (0 disables clipping)"),
        "z_loss": (lambda v: v >= 0, ">= 0"),
        "tail_k": (lambda v: v >= 1, ">= 1"),
    }
    for name, value in settings.items():
        ok, expected = rules[name]
        if not ok(value):
            raise UserError(f"model.{name} must be {expected}, got {value!r}")


class LanguageModel(L.LightningModule):
    """Next-token LM training for any residual strategy at any named size.

    Args:
        size: a named size from mhar_lit.config.NAMED_SIZES ("tiny", "demo", "100M", "350M", "1B", ...).
        residual: the residual strategy (class_path/init_args in YAML); the standard residual by default.
        model_overrides: ModelConfig fields that override the named size (e.g. {vocab_size: 512}).
        lr, betas, eps, weight_decay: AdamW settings. `decay_all_parameters` (paper) decays everything;
            False excludes norms, embeddings, biases and the strategy's gates / null sources / key norms.
        warmup_steps, decay_steps, min_lr_ratio: schedule; decay_steps 0 or None means trainer.max_steps.
        grad_clip: global-norm clipping (0 disables); the pre-clip norm is logged as train/grad_norm.
        z_loss: weight of mean(logsumexp(logits)^2) (0 disables).
        fused_loss: compute the LM head and the loss chunk by chunk with liger-kernel's cross-entropy kernel,
            never holding the fp32 logits of the whole batch (mhar_lit.kernels.linear_cross_entropy; on in the
            paper recipes). Same loss and gradients as the plain path within rounding; captured and eager alike.
        fused_ops: liger-kernel's Triton RMSNorm, RoPE and SiLU * up in place of the decoder's plain elementwise
            ops on CUDA (DecoderLM.fused_ops): a few kernels where there were ~25 per layer, for the launch-bound
            captured step. Same values to rounding (tests/test_fused_ops.py); weights and config unchanged.
        activation_checkpointing: recompute sublayers in backward. compile: torch.compile the decoder.
        cuda_graph: capture the training forward and backward as CUDA graphs at the first batch (removes the
            per-kernel host cost that makes the paper's microbatches host-bound; needs CUDA, precision
            "bf16-true", "bf16-mixed" or "32-true", one device; see mhar_lit.lit.cuda_graph). None (the default):
            capture wherever that holds, else train eagerly; the path taken and why is logged once at the first batch.
            True: capture or refuse the run; False: eager.
        tail_k: number of last validations averaged into val/tail_mean (the paper's metric uses 11).
        init_from: a directory written by `python -m mhar_lit convert` or a .safetensors file to start from.

    The strategy's `routing_parameters()` get their own AdamW group at lr x its `routing_lr_scale` when that
    is not 1 (an option of the routing strategies: docs/method.md "Beyond the paper: routing learning rate").
    """

    def __init__(
        self,
        size: str = "tiny",
        residual: Optional[ResidualStrategy] = None,
        model_overrides: Optional[dict[str, Any]] = None,
        lr: float = 5e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        decay_all_parameters: bool = True,
        warmup_steps: int = 1000,
        decay_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
        grad_clip: float = 1.0,
        z_loss: float = 0.0,
        fused_loss: bool = False,
        fused_ops: bool = False,
        activation_checkpointing: bool = False,
        compile: bool = False,
        cuda_graph: Optional[bool] = None,
        tail_k: int = 11,
        init_from: Optional[str] = None,
    ) -> None:
        super().__init__()
        _check_training_settings(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, warmup_steps=warmup_steps,
                                 decay_steps=decay_steps, min_lr_ratio=min_lr_ratio, grad_clip=grad_clip,
                                 z_loss=z_loss, tail_k=tail_k)
        self.save_hyperparameters()
        self.config = ModelConfig.from_name(size, **(model_overrides or {}))
        residual = residual if residual is not None else StandardResidual()
        if init_from:  # no random init of weights that are about to be overwritten
            from mhar_lit.convert.core import build_from_weights

            self.model = build_from_weights(self.config, residual, init_from)
        else:
            self.model = DecoderLM(self.config, residual)
        self.model.activation_checkpointing = activation_checkpointing
        self.model.fused_ops = fused_ops
        self.val_loss = MeanMetric(nan_strategy="error")
        self.val_history: list[float] = []
        if compile and cuda_graph:
            raise UserError("compile and cuda_graph are alternatives: set one of them")
        self._graphed_loss = None
        if cuda_graph is not False and not compile:
            from mhar_lit.lit.cuda_graph import GraphedLoss

            self._graphed_loss = GraphedLoss(required=bool(cuda_graph))
        if compile:
            self.model.compile()  # in place: no second module path in the state dict, hooks (FSDP) still run

    # ---------------------------------------------------------------- steps
    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids)

    def _loss(self, batch: Tensor) -> tuple[Tensor, Tensor, int]:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        ce, z = next_token_loss(self.model, inputs, targets, self.hparams.z_loss, self.hparams.get("fused_loss", False))
        return ce, z, targets.numel()

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        if self._graphed_loss is not None and self._graphed_loss.active(self):
            ce, z = self._graphed_loss(self, batch)
        else:
            ce, z, _ = self._loss(batch)
        loss = ce + self.hparams.z_loss * z
        # logged values are copies: a captured graph's outputs are overwritten by its next replay
        self.log("train/loss", ce.detach().clone(), prog_bar=True, sync_dist=True)  # the global mean under DDP
        if self.hparams.z_loss:
            self.log("train/z_loss", z.detach().clone())
        return loss

    def on_validation_epoch_start(self) -> None:
        # bf16-true casts the whole module, metric states included; a bf16 running mean is quantised to
        # ~0.008 at loss 1.5, coarser than the differences between methods. Keep the states in fp64.
        self.val_loss.set_dtype(torch.float64)

    on_test_epoch_start = on_validation_epoch_start

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        ce, _, tokens = self._loss(batch)
        self.val_loss.update(ce, weight=tokens)  # token-weighted: exact global mean under DDP

    def on_validation_epoch_end(self) -> None:
        value = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val/loss", value, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(value))
        if not self.trainer.sanity_checking and self.trainer.state.fn == "fit" and self._scheduled_validation():
            self.val_history.append(float(value))
            tail = self.val_history[-self.hparams.tail_k :]
            self.log("val/tail_mean", sum(tail) / len(tail))

    def _scheduled_validation(self) -> bool:
        """False for the extra validation Lightning runs when a fit is asked to stop between validations
        (max_time, a user's should_stop): the tail-mean averages the evaluation schedule only. (`validate`
        runs are kept out by the caller.)"""
        trainer = self.trainer
        every = trainer.val_check_batch
        if not trainer.should_stop or not isinstance(every, int) or trainer.check_val_every_n_epoch is not None:
            return True
        return (trainer.fit_loop.epoch_loop.total_batch_idx + 1) % every == 0

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        value = self.val_loss.compute()
        self.val_loss.reset()
        self.log("test/loss", value)
        self.log("test/ppl", torch.exp(value))

    def predict_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        """Per-sequence mean next-token loss (useful for scoring held-out text)."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self(inputs).float()
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(-1)

    # ---------------------------------------------------------------- optimisation
    def parameter_groups(self) -> list[dict[str, Any]]:
        groups = self._weight_decay_groups()
        scale = self.model.residual.routing_lr_scale
        return groups if scale == 1.0 else self._with_routing_group(groups, scale)

    def _with_routing_group(self, groups: list[dict[str, Any]], scale: float) -> list[dict[str, Any]]:
        """The strategy's routing parameters moved out of `groups` into a last group of their own with lr x scale
        (LambdaLR multiplies every group's own initial lr by the same schedule factor). They keep the weight
        decay of the group they came from."""
        routing = [p for p in self.model.residual.routing_parameters() if p.requires_grad]
        if not routing:
            raise UserError(f"routing_lr_scale {scale}: {self.model.residual.method_label()} has no trainable "
                             "routing parameters")
        moved = {id(p) for p in routing}
        home = next(g for g in groups if any(id(p) in moved for p in g["params"]))
        groups = [dict(g, params=[p for p in g["params"] if id(p) not in moved]) for g in groups]
        return groups + [{"params": routing, "weight_decay": home["weight_decay"], "lr": self.hparams.lr * scale}]

    def _weight_decay_groups(self) -> list[dict[str, Any]]:
        if self.hparams.decay_all_parameters:
            return [{"params": [p for p in self.model.parameters() if p.requires_grad],
                     "weight_decay": self.hparams.weight_decay}]
        skip = self._no_decay_names()
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (no_decay if name in skip or name.endswith(".bias") else decay).append(p)
        return [{"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    def _no_decay_names(self) -> set[str]:
        names = {"embed_tokens.weight"}
        for mod_name, module in self.model.named_modules():
            if isinstance(module, RMSNorm):
                names.add(f"{mod_name}.weight")
        names |= {f"residual.{n}" for n in self.model.residual.no_decay_parameter_names()}
        return names

    def configure_optimizers(self) -> dict[str, Any]:
        decay_steps = self.hparams.decay_steps or self.trainer.max_steps
        if not decay_steps or decay_steps < 0:
            raise UserError("set trainer.max_steps (or model.decay_steps) so the cosine schedule has an end")
        fused = self.device.type == "cuda"
        optimizer = torch.optim.AdamW(self.parameter_groups(), lr=self.hparams.lr, betas=tuple(self.hparams.betas),
                                      eps=self.hparams.eps, fused=fused)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_factor(step, self.hparams.warmup_steps, decay_steps, self.hparams.min_lr_ratio),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log("train/grad_norm", self._clip_gradients())
        self.log("train/lr", optimizer.param_groups[0]["lr"])

    def _clip_gradients(self) -> Tensor:
        """Clip to the global norm `grad_clip` (inf = measure only) and return the pre-clip global norm.

        Under Lightning's FSDP (FSDP1) every rank holds only shards of the gradients, so the norm must come
        from the root wrapper's clip_grad_norm_, which all-reduces; a per-rank clip_grad_norm_ would clip
        each shard by its own partial norm. FSDP2 (DTensor gradients) and DDP are handled by the plain call.
        """
        max_norm = self.hparams.grad_clip if self.hparams.grad_clip > 0 else float("inf")
        from torch.distributed.fsdp import FullyShardedDataParallel

        root = self.trainer.model if self._trainer is not None else None
        if isinstance(root, FullyShardedDataParallel):
            return root.clip_grad_norm_(max_norm)
        params = [p for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    # ---------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["mhar_lit"] = {
            "model_config": self.config.to_dict(),
            "residual": self.model.residual.to_config(),
            "val_history": list(self.val_history),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("mhar_lit")
        if saved is None:
            raise UserError("checkpoint was not written by mhar_lit (no 'mhar_lit' section); cannot resume from it")
        residual = self.model.residual
        mine = {"model_config": self.config.to_dict(), "residual": residual.identity()}
        saved = dict(saved, residual=type(residual).identity_of(saved["residual"]))
        for key in ("model_config", "residual"):
            if saved[key] != mine[key]:
                raise UserError(
                    f"checkpoint {key} does not match this run:\n  checkpoint: {saved[key]}\n  this run:   {mine[key]}"
                )
        self._check_optimizer_settings(checkpoint.get("hyper_parameters", {}))
        self.val_history = list(saved.get("val_history", []))

    # Restored with the optimizer state (its param groups) and LambdaLR's base_lrs, so a changed value would be
    # logged but not used; the schedule's shape (warmup, decay, floor), clipping and z-loss do follow the config.
    # (The strategy's routing_lr_scale is part of its identity, compared above.)
    OPTIMIZER_STATE_SETTINGS = ("lr", "betas", "eps", "weight_decay", "decay_all_parameters")

    def _check_optimizer_settings(self, saved: dict[str, Any]) -> None:
        if self._trainer is None or self.trainer.state.fn != "fit":
            return  # validate / test / predict restore weights only

        def norm(v):
            return tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else v

        differ = [f"{k}: checkpoint {saved[k]}, this run {self.hparams[k]}" for k in self.OPTIMIZER_STATE_SETTINGS
                  if k in saved and norm(saved[k]) != norm(self.hparams[k])]
        if differ:
            raise UserError("resuming would restore the checkpoint's optimizer state, whose settings differ from "
                             "this run's (they would be logged but not used): " + "; ".join(differ) + ". Resume "
                             "with the checkpoint's values")

    def on_fit_start(self) -> None:
        from mhar_lit.tracking import tag_run

        tag_run(self.trainer, self.model.residual, self.hparams.size, os.environ.get("PL_GLOBAL_SEED"))

    def setup(self, stage: str) -> None:
        if self.hparams.get("fused_loss") and "FSDP" in type(self.trainer.strategy).__name__:
            raise UserError("model.fused_loss reads lm_head.weight outside the LM head's forward, which FSDP does not "
                             "gather there: use one device or DDP, or fused_loss: false")
        data = getattr(self.trainer, "datamodule", None)
        vocab = getattr(data, "vocab_size", None)
        if vocab is not None and vocab > self.config.vocab_size:
            raise UserError(
                f"the tokenizer has {vocab} ids but the model's vocab_size is {self.config.vocab_size}; "
                f"set model.model_overrides.vocab_size >= {vocab}"
            )


