"""Block-mode Triton routing over a shared row buffer (BlockRouting, BlockAttnRes(backend="triton")) in the
interpreter. Fresh random inputs and random (never zero) queries every run; fp32 must match the float64
PyTorch reference to 1e-5 relative, bf16 stay within 2x the reference's own bf16 error + 1e-3 (as in
test_kernel_routing.py)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import fresh_generator, leaf, rel  # noqa: E402

from mhar_lit.kernels import launch as fast_launch  # noqa: E402
from mhar_lit.kernels.block_routing import A_SLOTS, BACKWARDS, BlockRouting  # noqa: E402
from mhar_lit.routing import route  # noqa: E402

NAMES = ("output", "d_embedding", "d_query", "d_norm_weight")


@pytest.fixture(autouse=True)
def audit_launch_keys(monkeypatch):
    monkeypatch.setattr(fast_launch, "AUDIT", True)
    fast_launch.clear_cache()
    yield
    fast_launch.clear_cache()


def _problem(layers, d, gen, b=2, t=3):
    n = 2 * layers + 1
    emb = torch.randn(b, t, d, generator=gen, dtype=torch.float64) * 2
    q = torch.randn(n, d, generator=gen, dtype=torch.float64)
    g = 1 + 0.3 * torch.randn(n, d, generator=gen, dtype=torch.float64)
    mats = [torch.randn(d, d, generator=gen, dtype=torch.float64) / d**0.5 for _ in range(n)]
    dout = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
    return emb, q, g, mats, dout


def _torch_block_sites(e, qq, gg, heads, span):
    """The reference: BlockAttnRes's bookkeeping (completed block sums + partial) with stacked torch routing;
    site_fn(s, y_prev) -> x_s."""
    n = qq.shape[0]
    state = {"blocks": [e], "partial": None}

    def site_fn(s, y_prev):
        if s > 0:
            state["partial"] = y_prev if state["partial"] is None else state["partial"] + y_prev
        if 0 < s < n - 1 and s % span == 0:
            state["blocks"].append(state["partial"])
            state["partial"] = None
        sources = state["blocks"] + ([state["partial"]] if state["partial"] is not None else [])
        return route(torch.stack(sources), qq[s], gg[s], heads)

    return site_fn


def _block_stack_loss(site_fn, e, mats, dout, outputs=None):
    """y_s = tanh(x_s @ M_s) feeds site s+1; the loss touches every y and the final output through dout."""
    n = len(mats)
    ys, new = [], e
    for s in range(n):
        x = site_fn(s, new)
        if s < n - 1:
            new = torch.tanh(x @ mats[s])
            ys.append(new)
    if outputs is not None:
        outputs.append(x.detach())
    return (x.double() * dout).sum() + 0.01 * sum((y.double() ** 2).sum() for y in ys)


def _output_and_grads(kind, emb, q, g, mats, dout, heads, span, dtype, **knobs):
    e, qq, gg = leaf(emb.to(dtype), q.to(dtype), g.to(dtype))
    mats = [m.to(dtype) for m in mats]
    if kind == "torch":
        site_fn = _torch_block_sites(e, qq, gg, heads, span)
    else:
        routing = BlockRouting(e, qq, gg, heads, span, **knobs)
        site_fn = lambda s, new: routing.route(s, new, *((qq, gg) if s == 0 else (None, None)))  # noqa: E731
    outputs = []
    loss = _block_stack_loss(site_fn, e, mats, dout, outputs)
    return (outputs[0], *torch.autograd.grad(loss, (e, qq, gg)))


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("layers,span,heads,d", [
    (2, 2, 2, 8),     # one layer per block
    (3, 2, 3, 12),    # H not a power of two
    (4, 4, 4, 20),    # two layers per block, K = 5
    (2, 4, 1, 8),     # one block, single head: the final site routes over the embedding and the partial
    (6, 4, 2, 16),    # 13 sites: the dq/dg partials are reduced in two rounds of A_SLOTS
    (3, 2, 2, 192),   # K = 96, where the full-mode paths miss 1e-5 on some draws (docs/LOG.md); block does not
])

def test_fp32_matches_float64_reference(layers, span, heads, d, backward):
    assert 2 * 6 + 1 > A_SLOTS  # the last case spans more than one reduction round
    gen = fresh_generator()
    problem = _problem(layers, d, gen)
    exact = _output_and_grads("torch", *problem, heads, span, torch.float64)
    ref32 = _output_and_grads("torch", *problem, heads, span, torch.float32)
    got = _output_and_grads("triton", *problem, heads, span, torch.float32, backward=backward)
    for name, a, x, r in zip(NAMES, got, exact, ref32):
        assert rel(a, x) <= max(1e-5, 2 * rel(r, x)), (
            f"{name}: {rel(a, x):.2e}, fp32 reference {rel(r, x):.2e} (seed {gen.initial_seed()})")


@pytest.mark.parametrize("backward", BACKWARDS)
def test_float64_equals_reference_and_gradcheck(backward):
    gen = fresh_generator()
    problem = _problem(3, 6, gen, b=1, t=2)
    exact = _output_and_grads("torch", *problem, 2, 2, torch.float64)
    got = _output_and_grads("triton", *problem, 2, 2, torch.float64, backward=backward)
    for name, a, x in zip(NAMES, got, exact):
        assert rel(a, x) <= 1e-12, f"{name}: {rel(a, x):.1e} (seed {gen.initial_seed()})"
    emb, q, g, mats, dout = problem

    def fn(e, qq, gg):
        routing = BlockRouting(e, qq, gg, 2, span=2, backward=backward)
        site_fn = lambda s, new: routing.route(s, new, *((qq, gg) if s == 0 else (None, None)))  # noqa: E731
        return _block_stack_loss(site_fn, e, mats, dout)

    assert torch.autograd.gradcheck(fn, tuple(leaf(emb, q, g)), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_bf16_within_reference_rounding_error(backward):
    gen = fresh_generator()
    problem = _problem(4, 32, gen, b=2, t=4)
    exact = _output_and_grads("torch", *problem, 4, 4, torch.float64)
    ref = _output_and_grads("torch", *problem, 4, 4, torch.bfloat16)
    got = _output_and_grads("triton", *problem, 4, 4, torch.bfloat16, backward=backward)
    for name, a, r, x in zip(NAMES, got, ref, exact):
        assert rel(a, x) <= 2 * rel(r, x) + 1e-3, f"{name}: {rel(a, x):.2e} vs {rel(r, x):.2e}"


def test_tiling_and_repeats_change_nothing():
    """Token tiles regroup independent tokens (the dq/dg partials' order aside): equal to fp32 rounding;
    repeated runs are bitwise identical."""
    gen = fresh_generator()
    problem = _problem(4, 12, gen, b=3, t=5)
    base = _output_and_grads("triton", *problem, 3, 4, torch.float32)
    again = _output_and_grads("triton", *problem, 3, 4, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(base, again))
    for tile, warps, unroll, backward in ((16, 1, 1, "accumulate"), (64, 2, 2, "block_pass"),
                                          (4096, 4, 2, "accumulate"), (4096, 0, 1, "block_pass")):
        # 1, 4 and all 15 tokens per program; both backward versions (equal to fp32 summation order)
        got = _output_and_grads("triton", *problem, 3, 4, torch.float32, tile_elements=tile, num_warps=warps,
                                unroll=unroll, backward=backward)
        for name, a, b in zip(NAMES, got, base):
            assert rel(a, b) <= 1e-6, (
                f"tile {tile} unroll {unroll} {name}: {rel(a, b):.1e} (seed {gen.initial_seed()})")


def test_second_backward_of_a_retained_graph_and_state_release():
    import gc
    import weakref

    gen = fresh_generator()
    emb, q, g, mats, dout = _problem(2, 8, gen)
    e, qq, gg = leaf(emb.float(), q.float(), g.float())
    routing = BlockRouting(e, qq, gg, 2, span=2)
    site_fn = lambda s, new: routing.route(s, new, *((qq, gg) if s == 0 else (None, None)))  # noqa: E731
    loss = _block_stack_loss(site_fn, e, [m.float() for m in mats], dout)
    assert routing.sources_view(3).shape == (3, *emb.shape)  # block rows 0, 2 and site 3's partial
    state = [weakref.ref(t) for t in routing.saved_state()]
    first = torch.autograd.grad(loss, (e, qq, gg), retain_graph=True)
    second = torch.autograd.grad(loss, (e, qq, gg))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    gc.collect()
    assert [ref() is None for ref in state] == [True] * 3  # freed with the graph, while `loss` lives
    with pytest.raises(RuntimeError, match="released"):
        routing.sources_view(2)


def test_order_and_input_errors_are_named():
    x = torch.zeros(1, 2, 4)
    q = torch.ones(5, 4)
    with pytest.raises(ValueError, match="sites per block"):
        BlockRouting(x, q, q, 2, span=3)
    with pytest.raises(ValueError, match="sites per block"):
        BlockRouting(x, q, q, 2, span=8)  # 4 layer sites
    with pytest.raises(ValueError, match="divisible"):
        BlockRouting(x, q, q, 3, span=2)
    with pytest.raises(ValueError, match="unroll must be one of"):
        BlockRouting(x, q, q, 2, span=2, unroll=3)
    with pytest.raises(ValueError, match="num_warps"):
        BlockRouting(x, q, q, 2, span=2, num_warps=-1)
    with pytest.raises(ValueError, match="backward must be one of"):
        BlockRouting(x, q, q, 2, span=2, backward="atomic")
    routing = BlockRouting(x, q, q, 2, span=2)
    with pytest.raises(ValueError, match="site 0 must receive"):
        routing.route(0, x)
    routing.route(0, x, q, q)
    with pytest.raises(RuntimeError, match="expected site 1, got site 2"):
        routing.route(2, x)
    with pytest.raises(ValueError, match="does not match"):
        routing.route(1, torch.zeros(1, 3, 4))


def test_unused_final_output_raises():
    gen = fresh_generator()
    emb, q, g, _, _ = _problem(1, 8, gen)
    e, qq, gg = leaf(emb.float(), q.float(), g.float())
    routing = BlockRouting(e, qq, gg, 2, span=2)
    x0 = routing.route(0, e, qq, gg)
    x1 = routing.route(1, x0 * 2)
    routing.route(2, torch.tanh(x1))  # the final site's output never reaches the loss
    with pytest.raises(RuntimeError, match="reverse order"):
        x1.sum().backward()
