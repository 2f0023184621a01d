"""Block-mode Triton routing over a shared row buffer (BlockRouting, BlockAttnRes(backend="triton")) in the
interpreter. Fresh random inputs and random (never zero) queries every run; fp32 must match the float64
PyTorch reference to 1e-5 relative, bf16 stay within 2x the reference's own bf16 error + 1e-3 (as in
test_kernel_routing.py)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import (ShiftToMisaligned, block_mode_output_and_grads, block_mode_problem,  # noqa: E402
                            block_stack_loss, fresh_generator, leaf, permuted_within_heads, rel, torch_block_sites)

from mhar_lit.kernels.block_routing import BlockRouting  # noqa: E402
from mhar_lit.kernels.host import split_w  # noqa: E402

NAMES = ("output", "d_embedding", "d_query", "d_norm_weight")



@pytest.mark.parametrize("layers,span,heads,d", [
    (2, 2, 2, 8),     # one layer per block
    (3, 2, 3, 12),    # H not a power of two
    (4, 4, 4, 20),    # two layers per block, K = 5
    (2, 4, 1, 8),     # one block, single head: the final site routes over the embedding and the partial
    (6, 4, 2, 16),    # 13 sites, 3 blocks: pairs from three block passes
    (5, 2, 2, 8),     # 11 sites, 5 blocks of one layer: the dq/dg pass's rows mostly block rows
])
@pytest.mark.parametrize("tokens", [(2, 3), (1, 70)])  # 70: the dq/dg pass sums two token blocks of 64
def test_fp32_matches_float64_reference(layers, span, heads, d, tokens):
    gen = fresh_generator()
    problem = block_mode_problem(layers, d, gen, *tokens)
    exact = block_mode_output_and_grads("torch", *problem, heads, span, torch.float64)
    ref32 = block_mode_output_and_grads("torch", *problem, heads, span, torch.float32)
    got = block_mode_output_and_grads("triton", *problem, heads, span, torch.float32)
    for name, a, x, r in zip(NAMES, got, exact, ref32):
        assert rel(a, x) <= max(1e-5, 2 * rel(r, x)), (
            f"{name}: {rel(a, x):.2e}, fp32 reference {rel(r, x):.2e} (seed {gen.initial_seed()})")


WIDE_DRAWS = 12


@pytest.mark.slow
def test_wide_head_fp32_error_is_torch_fp32_sized():
    """K = 96 (d 192, H 2, 7 sites) is an ill-conditioned chain: every fp32 evaluation is ~5e-6 off float64,
    and which one is luckier changes per draw by more than 2x. Over 30 draws torch fp32 with the features
    permuted inside each head (the same algorithm, another rounding order) fails the other cases' per-draw
    criterion, max(1e-5, 2x torch fp32's error), on 10-13% of draws, and this path on 3% (a CI failure on
    2026-12-04; benchmarks/results/precision_wide_head_block_2026-12-04_*.txt). So this case is held to the
    RMS over WIDE_DRAWS fresh draws: at most 3x the larger of the two torch evaluations' RMS (30 draws: 0.5-
    0.8x; the 99.9th percentile of a 12-draw bootstrap from those 30 is 1.9, and 30 draws say little about
    such a tail, hence 3x for 8 checks per run), and each draw within 10x of max(1e-5, either torch error)
    as a guard against gross errors (the largest seen: 2.8x). A defect that costs precision (a term
    rounded to bf16, a wrong rescaling) shows up orders of magnitude above either bound."""
    gen = fresh_generator()
    sq = torch.zeros(3, len(NAMES), dtype=torch.float64)  # squared errors: triton, torch, permuted torch
    for _ in range(WIDE_DRAWS):
        problem = block_mode_problem(3, 192, gen)
        exact = block_mode_output_and_grads("torch", *problem, 2, 2, torch.float64)
        ref32 = block_mode_output_and_grads("torch", *problem, 2, 2, torch.float32)
        moved, back = permuted_within_heads(problem, 2, gen)
        perm32 = back(block_mode_output_and_grads("torch", *moved, 2, 2, torch.float32))
        got = block_mode_output_and_grads("triton", *problem, 2, 2, torch.float32)
        for i, (name, a, r, p, x) in enumerate(zip(NAMES, got, ref32, perm32, exact)):
            errs = torch.tensor([rel(a, x), rel(r, x), rel(p, x)], dtype=torch.float64)
            assert errs[0] <= 10 * max(1e-5, errs[1], errs[2]), (
                f"{name}: {errs.tolist()} (seed {gen.initial_seed()})")
            sq[:, i] += errs**2
    rms = (sq / WIDE_DRAWS).sqrt()
    for i, name in enumerate(NAMES):
        assert rms[0, i] <= 3 * max(rms[1, i], rms[2, i]), (
            f"{name}: RMS {rms[0, i]:.2e} vs torch {rms[1, i]:.2e} / permuted {rms[2, i]:.2e} "
            f"(seed {gen.initial_seed()})")


def test_float64_equals_reference_and_gradcheck():
    gen = fresh_generator()
    problem = block_mode_problem(3, 6, gen, b=1, t=2)
    exact = block_mode_output_and_grads("torch", *problem, 2, 2, torch.float64)
    got = block_mode_output_and_grads("triton", *problem, 2, 2, torch.float64)
    for name, a, x in zip(NAMES, got, exact):
        assert rel(a, x) <= 1e-12, f"{name}: {rel(a, x):.1e} (seed {gen.initial_seed()})"
    emb, q, g, mats, dout = problem

    def fn(e, qq, gg):
        routing = BlockRouting(e, qq, gg, 2, span=2)
        site_fn = lambda s, new: routing.route(s, new, *((qq, gg) if s == 0 else (None, None)))  # noqa: E731
        return block_stack_loss(site_fn, e, mats, dout)

    # fast_mode: a random projection v^T J u of the Jacobian, numerical against analytical (~1 s in the interpreter
    # instead of ~16 s for every entry). It still fails for dq or dg 1% off and for one entry of one source's
    # gradient 1% off (checked by hand, 2026-12-08); entry-wise float64 equality with the PyTorch router is the
    # assertion above.
    assert torch.autograd.gradcheck(fn, tuple(leaf(emb, q, g)), eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_storage_within_reference_rounding_error(dtype):
    gen = fresh_generator()
    problem = block_mode_problem(4, 32, gen, b=2, t=4)
    exact = block_mode_output_and_grads("torch", *problem, 4, 4, torch.float64)
    ref = block_mode_output_and_grads("torch", *problem, 4, 4, dtype)
    got = block_mode_output_and_grads("triton", *problem, 4, 4, dtype)
    for name, a, r, x in zip(NAMES, got, ref, exact):
        assert rel(a, x) <= 2 * rel(r, x) + 1e-3, f"{dtype} {name}: {rel(a, x):.2e} vs {rel(r, x):.2e}"


def test_split_w_parts():
    """bf16 rows: w rounded to hi + lo (bf16 parts; |w - hi - lo| <= 2^-17 |w|), the rounded value returned
    with them; other dtypes: w itself and no second part (the same tensor twice)."""
    gen = fresh_generator()
    w = torch.randn(5, 64, generator=gen) * torch.randn(5, 64, generator=gen).exp()
    rounded, (hi, lo) = split_w(w, torch.bfloat16)
    assert hi.dtype == lo.dtype == torch.bfloat16 and torch.equal(hi, w.to(torch.bfloat16))
    assert torch.equal(rounded, hi.float() + lo.float())
    assert ((w - rounded).abs() <= 2.0 ** -17 * w.abs()).all()
    for dtype in (torch.float16, torch.float32):
        same, (a, b) = split_w(w, dtype)
        assert torch.equal(same, w) and a is same and b is same


@pytest.mark.slow
def test_tiling_and_repeats_change_nothing():
    """Token tiles regroup independent tokens (dq/dg come from a pass whose token blocks do not follow them):
    equal to fp32 rounding (a GPU's reductions may follow the tile); repeated runs are bitwise identical."""
    gen = fresh_generator()
    problem = block_mode_problem(4, 12, gen, b=3, t=5)
    base = block_mode_output_and_grads("triton", *problem, 3, 4, torch.float32)
    again = block_mode_output_and_grads("triton", *problem, 3, 4, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(base, again))
    # 1, 4 and all 15 tokens per program; the block pass with its own tile
    configs = ((16, 1, {}), (64, 2, {}), (4096, 4, {}), (4096, 0, {}),
               (64, 2, dict(pass_tile_elements=16)),
               (16, 1, dict(pass_tile_elements=4096, pass_warps=2)),
               (64, 2, dict(stages=1)))  # loops not software-pipelined (the interpreter ignores stages)
    for tile, warps, pass_knobs in configs:
        got = block_mode_output_and_grads("triton", *problem, 3, 4, torch.float32, tile_elements=tile,
                                          num_warps=warps, **pass_knobs)
        for name, a, b in zip(NAMES, got, base):
            assert rel(a, b) <= 1e-6, (f"tile {tile} warps {warps} {pass_knobs} {name}: {rel(a, b):.1e} "
                                       f"(seed {gen.initial_seed()})")


def test_second_backward_of_a_retained_graph_and_state_release():
    import gc
    import weakref

    gen = fresh_generator()
    emb, q, g, mats, dout = block_mode_problem(2, 8, gen)
    e, qq, gg = leaf(emb.float(), q.float(), g.float())
    routing = BlockRouting(e, qq, gg, 2, span=2)
    site_fn = lambda s, new: routing.route(s, new, *((qq, gg) if s == 0 else (None, None)))  # noqa: E731
    loss = block_stack_loss(site_fn, e, [m.float() for m in mats], dout)
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
    with pytest.raises(ValueError, match=r"unknown BlockRoutingConfig fields \['unroll'\]"):
        BlockRouting(x, q, q, 2, span=2, config=dict(unroll=2))
    with pytest.raises(ValueError, match="pass_tile_elements"):
        BlockRouting(x, q, q, 2, span=2, config=dict(pass_tile_elements=-1))
    with pytest.raises(ValueError, match="stages must be"):
        BlockRouting(x, q, q, 2, span=2, config=dict(stages=-1))
    with pytest.raises(ValueError, match="num_warps"):
        BlockRouting(x, q, q, 2, span=2, config=dict(num_warps=-1))
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
    emb, q, g, _, _ = block_mode_problem(1, 8, gen)
    e, qq, gg = leaf(emb.float(), q.float(), g.float())
    routing = BlockRouting(e, qq, gg, 2, span=2)
    x0 = routing.route(0, e, qq, gg)
    x1 = routing.route(1, x0 * 2)
    routing.route(2, torch.tanh(x1))  # the final site's output never reaches the loss
    with pytest.raises(RuntimeError, match="reverse order"):
        x1.sum().backward()

def test_misaligned_douts_route_the_same(monkeypatch):
    """Output gradients off a 16-byte boundary: the block pass reads the douts through an address table as
    16-byte aligned rows (tl.multiple_of, which the interpreter ignores), so BlockRouting must enter an aligned
    copy of such a dout: every address entered is checked here, and the results equal those of aligned douts."""
    import mhar_lit.kernels.block_routing as block_routing

    entered = []  # (dout tensor, address entered into the table) of every site kernel launch

    class RecordingKernel:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                entered.append((args[4], args[-1]))
                return real_kernel[grid](*args, **kwargs)
            return run

    real_kernel = block_routing.block_kernels._block_site_bwd_kernel
    monkeypatch.setattr(block_routing.block_kernels, "_block_site_bwd_kernel", RecordingKernel())
    gen = fresh_generator()
    emb, q, g, mats, dout = block_mode_problem(4, 12, gen)
    results = []
    for shift in (False, True):
        e, qq, gg = leaf(emb.float(), q.float(), g.float())
        routing = BlockRouting(e, qq, gg, 3, span=4)

        def site_fn(s, new):
            out = routing.route(s, new, *((qq, gg) if s == 0 else (None, None)))
            # its backward hands the routing a misaligned dout
            return ShiftToMisaligned.apply(out) if shift and s % 2 == 1 else out

        outputs = []
        loss = block_stack_loss(site_fn, e, [m.float() for m in mats], dout, outputs)
        results.append((outputs[0], *torch.autograd.grad(loss, (e, qq, gg))))
    assert len(entered) == 2 * 9
    assert all(addr == t.data_ptr() and addr % 16 == 0 for t, addr in entered), [a % 16 for _, a in entered]
    assert all(torch.equal(a, b) for a, b in zip(*results)), f"seed {gen.initial_seed()}"


def test_kept_dsrc_is_not_accumulated_into():
    """A site's dsrc is kept as the chain of the site before (the gradient of its partial sum). Here every
    sublayer output y reaches the routing as y + y / 2, whose backward hands the very dsrc tensor to y and a
    scaled copy to y / 2: autograd then sums two gradients for y, and must not do so in place in the kept
    tensor (it does not while BlockRouting holds a reference). fp32 against the float64 reference."""
    gen = fresh_generator()
    problem = block_mode_problem(4, 16, gen)

    def grads(kind, dtype):
        emb, q, g, mats, dout = problem
        e, qq, gg = leaf(emb.to(dtype), q.to(dtype), g.to(dtype))
        if kind == "torch":
            inner = torch_block_sites(e, qq, gg, 2, 4)
        else:
            routing = BlockRouting(e, qq, gg, 2, span=4)
            inner = lambda s, new: routing.route(s, new, *((qq, gg) if s == 0 else (None, None)))  # noqa: E731
        site_fn = lambda s, new: inner(s, new if s == 0 else torch.add(new, new / 2))  # noqa: E731
        loss = block_stack_loss(site_fn, e, [m.to(dtype) for m in mats], dout)
        return torch.autograd.grad(loss, (e, qq, gg))

    exact, ref32, got = grads("torch", torch.float64), grads("torch", torch.float32), grads("triton", torch.float32)
    for name, a, r, x in zip(NAMES[1:], got, ref32, exact):
        assert rel(a, x) <= max(1e-5, 2 * rel(r, x)), f"{name}: {rel(a, x):.2e} (seed {gen.initial_seed()})"
