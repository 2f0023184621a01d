"""The routing op: multi-head math against independent single-head formulas, dtypes, gradients, errors."""

import pytest
import torch

from mhar_lit.routing import route, routing_weights
from seeds import draw_seed


def _random_case(n=5, b=2, t=3, d=16, dtype=torch.float64, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else draw_seed())
    sources = torch.randn(n, b, t, d, generator=g, dtype=torch.float64) * (1 + torch.rand(n, 1, 1, 1, generator=g, dtype=torch.float64) * 3)
    query = torch.randn(d, generator=g, dtype=torch.float64)
    norm_weight = 1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    return sources.to(dtype), query.to(dtype), norm_weight.to(dtype)


def single_head_formula(sources, query, norm_weight, eps=1e-6):
    """docs/method.md B written out directly: softmax_n <q, RMSNorm_g(S_n)>, mix of unnormalised sources (float64)."""
    s = sources.double()
    keys = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    logits = torch.einsum("nbtd,d->nbt", keys, query.double())
    alpha = torch.softmax(logits, dim=0)
    return torch.einsum("nbt,nbtd->btd", alpha, s)


def test_single_head_equals_formula():
    """H = 1 is exactly the single-head (Kimi) formula."""
    sources, q, g = _random_case()
    torch.testing.assert_close(route(sources, q, g, heads=1), single_head_formula(sources, q, g), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("heads", [2, 4, 8])
def test_each_head_is_a_single_head_route_on_its_slice_with_full_width_statistic(heads):
    """Head h = single-head routing of slice h, whose keys use the RMS statistic of the FULL row."""
    sources, q, g = _random_case(d=16)
    out = route(sources, q, g, heads=heads)
    k = 16 // heads
    rms = torch.sqrt(sources.pow(2).mean(-1, keepdim=True) + 1e-6)
    for h in range(heads):
        sl = slice(h * k, (h + 1) * k)
        logits = torch.einsum("nbtk,k->nbt", sources[..., sl] / rms * g[sl], q[sl])
        expected = torch.einsum("nbt,nbtk->btk", logits.softmax(0), sources[..., sl])
        torch.testing.assert_close(out[..., sl], expected, rtol=1e-12, atol=1e-12)


def test_per_slice_statistic_would_differ():
    """Guard: a per-slice RMS statistic gives a measurably different result (so the test above has teeth)."""
    sources, q, g = _random_case(d=16)
    out = route(sources, q, g, heads=4)
    sl = slice(0, 4)
    rms_slice = torch.sqrt(sources[..., sl].pow(2).mean(-1, keepdim=True) + 1e-6)
    logits = torch.einsum("nbtk,k->nbt", sources[..., sl] / rms_slice * g[sl], q[sl])
    wrong = torch.einsum("nbt,nbtk->btk", logits.softmax(0), sources[..., sl])
    assert (out[..., sl] - wrong).abs().max() > 1e-3


def test_zero_query_is_uniform_mean():
    sources, _, g = _random_case()
    out = route(sources, torch.zeros(16, dtype=torch.float64), g, heads=4)
    torch.testing.assert_close(out, sources.mean(0), rtol=1e-12, atol=1e-12)


def test_bf16_storage_uses_fp32_math_and_returns_storage_dtype():
    """bf16 in, bf16 out; the result is within one bf16 rounding of the fp64 route of the same bf16 inputs."""
    sources, q, g = _random_case(dtype=torch.bfloat16)
    out = route(sources, q, g, heads=4)
    assert out.dtype == torch.bfloat16
    exact = route(sources.double(), q.double(), g.double(), heads=4)
    # Keys are rounded to bf16 (storage convention) before the dot: logit errors ~ 2^-8 relative, so compare
    # to fp64 at a few bf16 ulps of the output scale.
    err = (out.double() - exact).abs().max() / exact.abs().max()
    assert err < 2e-2, err
    weights = routing_weights(sources, q, g, heads=4)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(0), torch.ones_like(weights.sum(0)))


def test_gradcheck_float64():
    """float64 gradcheck of route w.r.t. sources, query and key-norm weight on small shapes."""
    sources, q, g = _random_case(n=3, b=1, t=2, d=8)
    inputs = tuple(x.clone().requires_grad_() for x in (sources, q, g))
    assert torch.autograd.gradcheck(lambda s, qq, gg: route(s, qq, gg, heads=2), inputs)


def test_bad_arguments_raise_clear_errors():
    sources, q, g = _random_case(d=12)
    with pytest.raises(ValueError, match="hidden size 12 is not divisible by the number of routing heads 5"):
        route(sources, q, g, heads=5)
    with pytest.raises(ValueError, match=r"sources must be \[N, B, T, D\]"):
        route(sources[0], q, g, heads=2)
    with pytest.raises(ValueError, match="must both be"):
        route(sources, q[:4], g, heads=2)
    with pytest.raises(ValueError, match="unknown routing backend"):
        route(sources, q, g, heads=2, backend="cuda")
