"""The routing-backend callback: the one place a training run chooses the depth-routing backend. It picks the
backend, sets it on the strategy (RoutedResidual.set_routing_backend), checks it once against the reference
and logs it. Strategies take no backend argument, so nothing in the model config competes with this choice.

backend="auto" uses the fused Triton kernels on CUDA and the PyTorch reference elsewhere. When Triton is
selected, the first real training batch is checked twice:
- the model's logits through both backends (no grad), which catches an integration error;
- the router alone at the model's shape (width, sites, heads, mode, dtype, kernel config) on random routing
  parameters, forward and backward (mhar_lit.routing.check): the model's own queries start at zero, where every
  routing weight is uniform and a wrong per-head logit or any backward error would pass the first comparison.
A failed check is an error unless `fallback=True`, in which case the run continues on the reference and says so
loudly (warning + logged tag). Nothing is ever switched silently.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from mhar_lit.residual.attnres import RoutedResidual
from mhar_lit.routing.check import compare_with_reference

log = logging.getLogger(__name__)

CHOICES = ("auto", "torch", "triton")
ROUTER_CHECK_TOKENS = 64  # tokens of the first sequence in the router check: its float64 reference keeps every
# site's source stack for the backward (O(sites^2) rows), ~2 GB at the 1B shape with 64 tokens


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _timed_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    if input_ids.is_cuda:
        torch.cuda.synchronize(input_ids.device)
    start = time.perf_counter()
    logits = model(input_ids)
    if input_ids.is_cuda:
        torch.cuda.synchronize(input_ids.device)
    return logits.float(), (time.perf_counter() - start) * 1e3


def compare_backends(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[str, float]:
    """Relative max error of the Triton forward against the reference on `input_ids`, plus both times."""
    residual = model.residual
    original = residual.routing_choice
    try:
        with torch.no_grad():
            residual.set_routing_backend("torch")
            ref, torch_ms = _timed_logits(model, input_ids)
            residual.set_routing_backend("triton", original[1] if original[0] == "triton" else None)
            out, triton_ms = _timed_logits(model, input_ids)
    finally:
        residual.set_routing_backend(*original)
    rel = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    result = {"rel_err": rel, "torch_forward_ms": torch_ms, "triton_forward_ms": triton_ms}
    nonfinite = tuple(name for name, logits in (("reference", ref), ("triton", out)) if not torch.isfinite(logits).all())
    if nonfinite:  # NaN compares False with any tolerance: name it, so the check fails instead of passing
        result["nonfinite"] = nonfinite
        result["error"] = f"non-finite logits from {' and '.join(nonfinite)}"
    return result


def check_router(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[str, object]:
    """The router check of mhar_lit.routing.check at this model's shape, with its triton kernel config."""
    residual = model.residual
    with torch.no_grad():
        embedding = model.embed_tokens(input_ids[:1, :ROUTER_CHECK_TOKENS])
    kernel_config = residual.routing_choice[1] if residual.routing_mode != "call" else None
    return compare_with_reference(residual.routing_mode, "triton", residual.heads, embedding,
                                  residual.query.shape[0], residual.query.dtype, residual.eps,
                                  residual.router_options(), kernel_config)


def is_sharded(trainer: L.Trainer) -> bool:
    """True under strategies that shard parameters (FSDP, model parallel)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    return isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy))


class RoutingBackend(L.Callback):
    """Selects and validates the depth-routing backend of attention-residual strategies.

    Args:
        backend: "auto" (Triton on CUDA, reference otherwise), "torch" or "triton".
        check: compare Triton with the reference on the first training batch.
        tolerance: maximum relative logit error (default: 5e-2 in bf16/fp16, 1e-4 in fp32); bf16 runs differ
            by rounding order only, and the fused kernel is the more accurate of the two (docs/method.md I).
        fallback: on a failed check, continue with the reference instead of raising.
        check_sequences: sequences of the first batch used for the check.
    """

    def __init__(self, backend: str = "auto", check: bool = True, tolerance: Optional[float] = None,
                 fallback: bool = False, check_sequences: int = 1) -> None:
        if backend not in CHOICES:
            raise ValueError(f"routing backend must be one of {CHOICES}, got {backend!r}")
        if tolerance is not None and not tolerance >= 0:
            raise ValueError(f"routing_backend.tolerance must be >= 0 (or null for the default), got {tolerance}")
        if check_sequences < 1:
            raise ValueError(f"routing_backend.check_sequences must be >= 1, got {check_sequences}")
        self.backend, self.check, self.tolerance = backend, check, tolerance
        self.fallback, self.check_sequences = fallback, check_sequences
        self._pending_check = False
        self.report: dict[str, object] = {}

    def resolve(self, device: torch.device) -> str:
        if self.backend != "auto":
            return self.backend
        return "triton" if device.type == "cuda" and triton_available() else "torch"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        residual = pl_module.model.residual
        if not isinstance(residual, RoutedResidual):
            return
        chosen = self.resolve(trainer.strategy.root_device)
        if chosen == "triton" and not triton_available():
            raise RuntimeError("routing backend 'triton' was requested but triton is not installed")
        # a kernel config given in library code is kept where it applies (the same backend)
        residual.set_routing_backend(chosen, residual.routing_choice[1] if chosen == residual.backend else None)
        self._pending_check = chosen == "triton" and self.check and stage == "fit"
        self.report = {"routing_backend": chosen}
        # printed, as the capture decision is (mhar_lit's own loggers print warnings only)
        rank_zero_info(f"depth routing backend: {chosen}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._pending_check:
            return
        self._pending_check = False
        if is_sharded(trainer):
            # The decoder's parameters are shards here; a side forward outside the FSDP root would read them
            # unsharded-less (and, on one rank only, desynchronise collectives). Say so instead of checking.
            log.warning("routing backend check skipped under %s (parameters are sharded); the kernels are "
                        "covered by the test suite", type(trainer.strategy).__name__)
            self.report["routing_check"] = "skipped (sharded strategy)"
            self._log(trainer)
            return
        dtype = next(pl_module.model.parameters()).dtype
        tolerance = self.tolerance if self.tolerance is not None else (1e-4 if dtype == torch.float32 else 5e-2)
        try:
            result = compare_backends(pl_module.model, batch[: self.check_sequences, :-1])
            if "error" not in result:
                router = check_router(pl_module.model, batch[:, :-1])
                result.update({f"router_{k}": v for k, v in router.items() if k not in ("passed", "failed")})
                if not router["passed"]:
                    result["error"] = ("routing on random queries, forward and backward: "
                                       + "; ".join(router["failed"]))
        except Exception as err:  # a kernel that cannot run is a failed check, subject to `fallback`
            result = {"rel_err": float("inf"), "error": f"{type(err).__name__}: {err}"}
        self.report.update({f"routing_check_{k}": v for k, v in result.items()})
        self.report["routing_check_tolerance"] = tolerance
        if "error" in result or not result["rel_err"] <= tolerance:  # `not <=`: a NaN error fails too
            message = (f"Triton routing differs from the reference on the first batch: relative error "
                       f"{result['rel_err']:.3g}, tolerance {tolerance:.3g}")
            if "error" in result:
                message += f" ({result['error']})"
            if "reference" in result.get("nonfinite", ()):  # the model itself diverged: nothing to fall back to
                raise RuntimeError(message + ": the PyTorch reference's logits are not finite (the model diverged)")
            if not self.fallback:
                raise RuntimeError(message + " (set routing_backend.fallback=true to continue on the reference)")
            log.warning("%s; falling back to the PyTorch reference as configured", message)
            pl_module.model.residual.set_routing_backend("torch")
            self.report["routing_backend"] = "torch (fallback after failed check)"
        self._log(trainer)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.report and not self._pending_check:
            self._log(trainer)

    def _log(self, trainer: L.Trainer) -> None:
        numbers = {k: float(v) for k, v in self.report.items() if isinstance(v, (int, float))}
        from lightning.pytorch.loggers import MLFlowLogger

        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):  # a tag, since MLflow params are immutable across resumes
                logger.experiment.set_tag(logger.run_id, "routing_backend", self.report["routing_backend"])
                if "routing_check_error" in self.report:  # why a check failed (a string: not a metric)
                    logger.experiment.set_tag(logger.run_id, "routing_check_error", self.report["routing_check_error"])
            else:
                logger.log_hyperparams({"routing_backend": self.report["routing_backend"]})
            if numbers:
                logger.log_metrics(numbers, step=trainer.global_step)
