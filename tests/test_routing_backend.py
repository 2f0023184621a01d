"""The Triton routing callback in real CPU fits (Triton's interpreter runs the kernels on CPU tensors).

What must hold: the backend is chosen at setup; with Triton chosen, the first training batch is run
through both backends and the error logged with the backend; a failed check is an error unless a fallback is
configured, and a fallback says so (warning and logged tag); nothing is switched silently.
"""

import logging

import lightning as L
import pytest
import torch
from capture_logger import CaptureLogger

from mhar_lit.lit.module import LanguageModel
from mhar_lit.lit.routing_backend import RoutingBackend
from mhar_lit.residual import BlockAttnRes, DeltaAttnRes, FullAttnRes, StandardResidual


def _fit(residual, callback, steps=2):
    torch.manual_seed(0)
    module = LanguageModel(size="tiny", residual=residual, warmup_steps=1)
    logger = CaptureLogger()
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=logger, callbacks=[callback],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    data = torch.randint(0, 256, (8, 17))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    return module, logger


def _perturb_triton_inputs(monkeypatch, value):
    """Makes FullAttnRes's Triton path wrong (or NaN) while leaving the reference alone."""
    original = FullAttnRes.sublayer_input

    def sublayer_input(self, state, site):
        out = original(self, state, site)
        if self.backend != "triton":
            return out
        return out + value if value == value else torch.full_like(out, float("nan"))

    monkeypatch.setattr(FullAttnRes, "sublayer_input", sublayer_input)


def test_auto_resolves_to_the_reference_on_cpu_and_runs_no_check():
    callback = RoutingBackend()
    module, logger = _fit(FullAttnRes(heads=4), callback)
    assert module.model.residual.backend == "torch"
    assert callback.report == {"routing_backend": "torch"} and logger.params["routing_backend"] == "torch"
    assert not any(k.startswith("routing_check") for k in logger.metrics)


@pytest.mark.parametrize("residual", [lambda: FullAttnRes(heads=4), lambda: BlockAttnRes(heads=2, layers_per_block=1)],
                         ids=["full", "block"])
def test_triton_is_checked_on_the_first_batch_and_logged(residual):
    callback = RoutingBackend(backend="triton")
    module, logger = _fit(residual(), callback)
    assert module.model.residual.backend == "triton"
    err = logger.metrics["routing_check_rel_err"]
    # fp32 parameters: both backends compute in fp32 and differ by summation order only (kernel tests: <= 1e-5)
    assert 0 <= err <= 1e-5, err
    assert logger.metrics["routing_check_tolerance"] == 1e-4
    assert logger.metrics["routing_check_torch_forward_ms"] > 0 and logger.metrics["routing_check_triton_forward_ms"] > 0
    assert logger.params["routing_backend"] == "triton"


@pytest.mark.parametrize("value", [1e-2, float("nan")], ids=["wrong", "nan"])
def test_failed_check_is_an_error_without_fallback(monkeypatch, value):
    _perturb_triton_inputs(monkeypatch, value)
    with pytest.raises(RuntimeError, match="Triton routing differs from the reference.*fallback=true"):
        _fit(FullAttnRes(heads=4), RoutingBackend(backend="triton"))


@pytest.mark.parametrize("value", [1e-2, float("nan")], ids=["wrong", "nan"])
def test_failed_check_with_fallback_continues_on_the_reference_and_says_so(monkeypatch, caplog, value):
    _perturb_triton_inputs(monkeypatch, value)
    callback = RoutingBackend(backend="triton", fallback=True)
    with caplog.at_level(logging.WARNING, logger="mhar_lit.lit.routing_backend"):
        module, logger = _fit(FullAttnRes(heads=4), callback)
    assert module.model.residual.backend == "torch"
    assert logger.params["routing_backend"] == "torch (fallback after failed check)"
    assert "falling back to the PyTorch reference" in caplog.text
    assert torch.isfinite(torch.tensor(float(module.trainer.callback_metrics["train/loss"])))


def test_kernel_error_is_a_failed_check(monkeypatch):
    def broken(self, state, site):
        if self.backend == "triton":
            raise ValueError("kernel exploded")
        return original(self, state, site)

    original = FullAttnRes.sublayer_input
    monkeypatch.setattr(FullAttnRes, "sublayer_input", broken)
    with pytest.raises(RuntimeError, match="kernel exploded"):
        _fit(FullAttnRes(heads=4), RoutingBackend(backend="triton"))


def test_zero_tolerance_is_kept_and_bad_options_are_refused():
    assert RoutingBackend(backend="triton", tolerance=0.0).tolerance == 0.0
    with pytest.raises(ValueError, match="routing backend must be one of"):
        RoutingBackend(backend="cuda")
    with pytest.raises(ValueError, match="tolerance"):
        RoutingBackend(tolerance=-1.0)
    with pytest.raises(ValueError, match="check_sequences"):
        RoutingBackend(check_sequences=0)


def test_strategies_without_routing_are_left_alone():
    callback = RoutingBackend(backend="triton")
    module, logger = _fit(StandardResidual(), callback)
    assert callback.report == {} and "routing_backend" not in logger.params


def test_non_finite_reference_is_an_error_even_with_fallback(monkeypatch):
    """When the PyTorch reference itself gives NaN, the model has diverged: falling back to it would be wrong."""
    original = FullAttnRes.sublayer_input

    def sublayer_input(self, state, site):
        out = original(self, state, site)
        return torch.full_like(out, float("nan")) if self.backend == "torch" else out

    monkeypatch.setattr(FullAttnRes, "sublayer_input", sublayer_input)
    with pytest.raises(RuntimeError, match="reference's logits are not finite"):
        _fit(FullAttnRes(heads=4), RoutingBackend(backend="triton", fallback=True), steps=1)


def test_zero_tolerance_runs_the_check_strictly():
    """tolerance 0 is kept (not replaced by the default): fp32 summation-order differences then fail the check."""
    callback = RoutingBackend(backend="triton", tolerance=0.0, fallback=True)
    module, logger = _fit(FullAttnRes(heads=4), callback, steps=1)
    assert logger.metrics["routing_check_tolerance"] == 0.0
    expected = "torch (fallback after failed check)" if logger.metrics["routing_check_rel_err"] > 0 else "triton"
    assert logger.params["routing_backend"] == expected


class _ScaleGradient(torch.autograd.Function):
    """Identity forward, gradient times 1.01 backward: a backward error that no forward comparison sees."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.01


@pytest.mark.parametrize("residual", [lambda: FullAttnRes(heads=4), lambda: BlockAttnRes(heads=2, layers_per_block=1),
                                      lambda: DeltaAttnRes(heads=2, layers_per_block=1)], ids=["full", "block", "delta"])
def test_router_check_on_random_queries_is_logged_and_passes(residual):
    """The router check (random queries, forward and backward) runs at the model's shape and passes for the
    real kernels: every compared tensor within 2x the fp32 PyTorch router's own error (plus 1e-6)."""
    callback = RoutingBackend(backend="triton")
    _, logger = _fit(residual(), callback, steps=1)
    assert 0 <= logger.metrics["routing_check_router_worst_ratio"] <= 1
    for name in ("outputs", "grad_sources", "grad_embedding", "grad_query", "grad_norm"):
        assert logger.metrics[f"routing_check_router_{name}_eager_rel_err"] > 0  # fp32 vs float64: a real error


@pytest.mark.parametrize("router_class", ["FullRouter", "BlockRouter"])
def test_a_backward_error_fails_the_check_although_the_logits_agree(monkeypatch, router_class):
    """At step 0 every query is zero and the logits comparison cannot see a wrong gradient; the router check can."""
    from mhar_lit.routing import triton_routers

    original = getattr(triton_routers, router_class).route

    def route(self, state, site):
        return _ScaleGradient.apply(original(self, state, site))

    monkeypatch.setattr(getattr(triton_routers, router_class), "route", route)
    residual = FullAttnRes(heads=4) if router_class == "FullRouter" else BlockAttnRes(heads=2, layers_per_block=1)
    with pytest.raises(RuntimeError, match="routing on random queries, forward and backward: grad_"):
        _fit(residual, RoutingBackend(backend="triton"), steps=1)


def test_the_routing_backend_is_printed(caplog):
    """The chosen backend is a line of the fit's output (benchmarks/gpu_acceptance.py reads it there), said through
    Lightning's rank-zero logger as the capture decision is: mhar_lit's own loggers print warnings only."""
    with caplog.at_level("INFO"):
        _fit(FullAttnRes(heads=2), RoutingBackend(backend="torch"), steps=1)
    said = [r.name for r in caplog.records if r.getMessage() == "depth routing backend: torch"]
    assert said and all(name.startswith("lightning.") for name in said), said
