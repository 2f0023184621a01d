"""Shared helpers of the kernel tests (and benchmarks/precision_wide_head.py): fresh random cases, relative
errors, reference full-mode and block-mode stacks."""

import torch

from mhar_lit.routing import route
from seeds import draw_seed


def fresh_generator() -> torch.Generator:
    """The test's seed (tests/seeds.py: fixed per test, fresh with MHAR_RANDOM_SEEDS=1)."""
    seed = draw_seed()
    return torch.Generator().manual_seed(seed)


def random_case(n, b, t, d, dtype, gen):
    """Sources of varied scale per row, a random (never zero) query and a non-trivial norm weight."""
    sources = torch.randn(n, b, t, d, generator=gen, dtype=torch.float64)
    sources = sources * (0.5 + 3 * torch.rand(n, 1, 1, 1, generator=gen, dtype=torch.float64))
    query = torch.randn(d, generator=gen, dtype=torch.float64)
    norm_weight = 1 + 0.3 * torch.randn(d, generator=gen, dtype=torch.float64)
    return sources.to(dtype), query.to(dtype), norm_weight.to(dtype)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def leaf(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def full_mode_loss(routing_fn, emb, q_SD, g_SD, mats, dout, outputs=None):
    """A full-mode stack without the model: site s routes S_0..S_s, S_{s+1} = tanh(x_s @ M_s); the loss
    touches every site output (through the sources) and the final one through dout. The final site's output
    is appended to `outputs` when given."""
    sources = [emb]
    x = None
    for s in range(q_SD.shape[0]):
        x = routing_fn(s, sources)
        if s < q_SD.shape[0] - 1:
            sources.append(torch.tanh(x @ mats[s]))
    if outputs is not None:
        outputs.append(x.detach())
    extra = sum((y.to(torch.float64) ** 2).sum() for y in sources[1:]) * 0.01
    return (x.to(torch.float64) * dout).sum() + extra


def full_mode_problem(n_sites, b, t, d, gen, query_std=0.25):
    """A float64 full-mode case: embedding [b, t, d], queries and norm weights [n_sites, d], one sublayer
    matrix per site and the final output's gradient."""
    emb = torch.randn(b, t, d, generator=gen, dtype=torch.float64) * 2
    # Queries of std 0.25 by default: logits of std ~1.7 per head at K = 48, weights still far from uniform. Larger
    # queries make the chain of 11 softmaxes amplify fp32 rounding for every evaluation alike: at std 1 the errors
    # against float64 ranged 1e-6 .. 5e-5 across 13 seeds for the PyTorch reference and the kernels; at std 0.5
    # up to 1.1e-5 over 40 seeds, for the kernels and for torch with its features permuted within heads (one draw
    # of 40 failed max(1e-5, 2x the reference's error)); at 0.25 at most 1.0e-6 over the same 40 seeds. So the
    # 1e-5 bound tests the kernels' own rounding, not the luck of a draw. The sharp regime keeps its own test
    # with a criterion made for it (test_kernel_full_routing.py: test_sharp_softmax_chain_error_is_torch_fp32_sized).
    q = query_std * torch.randn(n_sites, d, generator=gen, dtype=torch.float64)
    g = 1 + 0.3 * torch.randn(n_sites, d, generator=gen, dtype=torch.float64)
    mats = [torch.randn(d, d, generator=gen, dtype=torch.float64) / d**0.5 for _ in range(n_sites)]
    dout = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
    return emb, q, g, mats, dout


def full_mode_output_and_grads(kind, emb, q, g, mats, dout, heads, dtype, chunk=3, group=2, **knobs):
    """(final output, d_embedding, d_query, d_norm_weight) of the full-mode stack in `dtype`; kind "torch"
    routes with the reference, anything else with FullRouting (knobs go to it)."""
    e, qq, gg = leaf(emb.to(dtype), q.to(dtype), g.to(dtype))
    mats = [m.to(dtype) for m in mats]
    if kind == "torch":
        site_fn = torch_site(qq, gg, heads)
    else:
        from mhar_lit.kernels.full_routing import FullRouting  # needs triton; the helpers do not

        routing = FullRouting(e, qq, gg, heads, config=dict(chunk=chunk, group=group, **knobs))

        def site_fn(s, sources):
            params = (qq, gg) if s == 0 else (None, None)
            return routing.route(s, sources[-1], *params)

    outputs = []
    loss = full_mode_loss(site_fn, e, qq, gg, mats, dout, outputs)
    return (outputs[0], *torch.autograd.grad(loss, (e, qq, gg)))


def torch_site(q_SD, g_SD, heads):
    return lambda s, sources: route(torch.stack(sources), q_SD[s], g_SD[s], heads)


def query_grad_rounding_scale(sources, query, norm_weight, heads, dout, eps=1e-6):
    """||A_abs|| / ||A||, A = dL/dq / g = sum over tokens and sources of dl * kr (float64): how much the fp32
    rounding of the terms' parts is amplified by cancellation in dq (and dg = A q). dl = p (<dout, v> - S)
    subtracts two dot products of similar size, so A_abs sums p (|dout . v|_abs + |dout . out|_abs) |kr|
    with |x . y|_abs = sum |x_i y_i|. Draws where A nearly cancels get a proportionally wider tolerance."""
    from mhar_lit.routing import route_reference, routing_weights

    s, q, g, d = (x.double() for x in (sources, query, norm_weight, dout))
    n, b, t, dim = s.shape
    k = dim // heads
    p = routing_weights(s, q, g, heads, eps)  # [N, B, T, H]
    out = route_reference(s, q, g, heads, eps)
    kr = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    split = lambda x: x.reshape(*x.shape[:-1], heads, k)  # noqa: E731
    dv_abs = (split(d).abs() * split(s).abs()).sum(-1)  # [N, B, T, H]
    dout_abs = (split(d).abs() * split(out).abs()).sum(-1)  # [B, T, H]
    dl = p * ((split(d) * split(s)).sum(-1) - (split(d) * split(out)).sum(-1))
    a = (dl.unsqueeze(-1) * split(kr)).sum((0, 1, 2)).flatten()
    a_abs = (p * (dv_abs + dout_abs)).unsqueeze(-1).mul(split(kr).abs()).sum((0, 1, 2)).flatten()
    return (a_abs.norm() / a.norm().clamp_min(1e-300)).item()


def block_mode_problem(layers, d, gen, b=2, t=3):
    """A float64 block-mode case of `layers` layers: the full-mode case of its 2L+1 sites."""
    return full_mode_problem(2 * layers + 1, b, t, d, gen)


def torch_block_sites(e, qq, gg, heads, span):
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


def block_stack_loss(site_fn, e, mats, dout, outputs=None):
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


def block_mode_output_and_grads(kind, emb, q, g, mats, dout, heads, span, dtype, **knobs):
    """(final output, d_embedding, d_query, d_norm_weight) of the block-mode stack (span sites per block) in
    `dtype`; kind "torch" routes with the reference, anything else with BlockRouting (knobs go to it)."""
    e, qq, gg = leaf(emb.to(dtype), q.to(dtype), g.to(dtype))
    mats = [m.to(dtype) for m in mats]
    if kind == "torch":
        site_fn = torch_block_sites(e, qq, gg, heads, span)
    else:
        from mhar_lit.kernels.block_routing import BlockRouting  # needs triton; the helpers do not

        routing = BlockRouting(e, qq, gg, heads, span, config=knobs)
        site_fn = lambda s, new: routing.route(s, new, *((qq, gg) if s == 0 else (None, None)))  # noqa: E731
    outputs = []
    loss = block_stack_loss(site_fn, e, mats, dout, outputs)
    return (outputs[0], *torch.autograd.grad(loss, (e, qq, gg)))


def permuted_within_heads(problem, heads, gen):
    """A full- or block-mode case (emb, q, g, mats, dout) with the features permuted inside each head: the same
    function, whose fp32 evaluation rounds in another order; returns it and the map of its (output, d_emb, dq,
    dg) back to the original feature order."""
    emb, q, g, mats, dout = problem
    d = emb.shape[-1]
    k = d // heads
    perm = torch.cat([h * k + torch.randperm(k, generator=gen) for h in range(heads)])
    inv = torch.argsort(perm)
    moved = (emb[..., perm], q[:, perm], g[:, perm], [m[perm][:, perm] for m in mats], dout[..., perm])
    return moved, lambda r: (r[0][..., inv], r[1][..., inv], r[2][:, inv], r[3][:, inv])


def misaligned(x):
    """x's values in a view whose data pointer is 4 bytes past an aligned one."""
    buf = torch.empty(x.numel() + 1, dtype=x.dtype)
    view = buf[1:].view(x.shape)
    view.copy_(x)
    return view


class ShiftToMisaligned(torch.autograd.Function):
    """Identity whose forward output and backward gradient are misaligned views (see misaligned)."""

    @staticmethod
    def forward(ctx, x):
        return misaligned(x)

    @staticmethod
    def backward(ctx, grad):
        return misaligned(grad)
