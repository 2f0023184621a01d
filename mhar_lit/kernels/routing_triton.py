"""Per-call fused routing: `route_triton(sources, query, norm_weight, heads, eps)`, the "triton" backend of
mhar_lit.routing.route and the triton delta router. Same function as the reference, forward and backward, in Triton.

Forward (one launch): full-row programs of several tokens each run the online softmax over the N rows,
compute each row's RMS statistic once (kept, [N, P]) and write the output and the log-sum-exp [P, H].
Backward (one launch): the same programs recompute keys from the saved statistic, take the softmax
coupling S = <dout, out> per head, and write each source's finished gradient once (no fp32 accumulation
buffer); dq and dg come from per-program partials summed on the host (deterministic, no atomics).
Saved for backward: the sources, the output, r [N, P] and lse [P, H] (fp32), nothing of size N x D beyond
the sources themselves.
Both entries are torch.library custom ops (mhar_lit::route, mhar_lit::route_list, mhar_lit::route_backward)
with fake implementations, so torch.compile traces each call as one op (fullgraph works) and AOT autograd
sees its backward as another. Outside torch.compile the same implementations run under an autograd.Function
instead: a custom op's dispatcher cost 17-63 us of host time per call on two H200 machines (2026-12-04: 105.7 vs
88.8 and 132.8 vs 69.4 us for a tiny call), the Function path 3.6 us.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from mhar_lit.kernels import per_call
from mhar_lit.kernels.host import accumulator, check_device, check_storage_dtype, pow2, tile_tokens


def _launch_forward(rows_NPD: Tensor, w_1D: Tensor, heads: int, eps: float):
    n, p, d = rows_NPD.shape
    k = d // heads
    acc_t, acc_tl = accumulator(rows_NPD.dtype)
    h_p, k_p = pow2(heads), pow2(k)
    block_t = tile_tokens(h_p * k_p)
    r_NP = torch.empty(n, p, dtype=acc_t, device=rows_NPD.device)
    lse_PH = torch.empty(p, heads, dtype=acc_t, device=rows_NPD.device)
    out_PD = torch.empty(p, d, dtype=rows_NPD.dtype, device=rows_NPD.device)
    grid = (triton.cdiv(p, block_t),)
    per_call._site_fwd_kernel[grid](
        rows_NPD, r_NP, w_1D, out_PD, lse_PH, n, p, d, heads, k, eps,
        BLOCK_T=block_t, H_P=h_p, K_P=k_p, ACC=acc_tl, num_warps=4,
    )
    return out_PD, r_NP, lse_PH


def _launch_backward(rows_NPD: Tensor, r_NP: Tensor, w_1D: Tensor, lse_PH: Tensor, out_PD: Tensor,
                     dout_PD: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    n, p, d = rows_NPD.shape
    k = d // heads
    acc_t, acc_tl = accumulator(rows_NPD.dtype)
    h_p, k_p = pow2(heads), pow2(k)
    block_t = tile_tokens(h_p * k_p)
    programs = triton.cdiv(p, block_t)
    dsrc_NPD = torch.empty_like(rows_NPD)
    a_part = torch.empty(programs, d, dtype=acc_t, device=rows_NPD.device)
    per_call._site_bwd_kernel[(programs,)](
        rows_NPD, r_NP, w_1D, lse_PH, dout_PD, out_PD, dsrc_NPD, a_part, n, p, d, heads, k,
        BLOCK_T=block_t, H_P=h_p, K_P=k_p, ACC=acc_tl, num_warps=4,
    )
    return dsrc_NPD, a_part.sum(0)


# The per-call routing as torch.library custom ops, so torch.compile sees one opaque op per call (with fake
# implementations for tracing) instead of breaking the graph at the kernel launches; autograd through
# register_autograd. route / route_list return (out [B, T, D], r [N, P], lse [P, H]); r and lse are what the
# backward needs besides the sources (they are outputs because a custom op cannot keep state of its own).
def _route_impl(rows_NPD: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float):
    acc_t, _ = accumulator(rows_NPD.dtype)
    w = (query.detach().to(acc_t) * norm_weight.detach().to(acc_t)).view(1, -1).contiguous()
    return _launch_forward(rows_NPD, w, heads, eps)


def _route_fake(n: int, like: Tensor, dtype: torch.dtype, heads: int):
    b, t, d = like.shape[-3:]
    acc_t, _ = accumulator(dtype)
    return (like.new_empty(b, t, d, dtype=dtype), like.new_empty(n, b * t, dtype=acc_t),
            like.new_empty(b * t, heads, dtype=acc_t))


def _route_stacked(sources: Tensor, query: Tensor, norm_weight: Tensor, heads: int,
                   eps: float) -> tuple[Tensor, Tensor, Tensor]:
    check_device(sources, query, norm_weight)  # before any copy
    n, b, t, d = sources.shape
    out_PD, r_NP, lse_PH = _route_impl(sources.contiguous().view(n, b * t, d), query, norm_weight, heads, eps)
    return out_PD.view(b, t, d), r_NP, lse_PH


def _route_listed(sources: list[Tensor], query: Tensor, norm_weight: Tensor, heads: int,
                  eps: float) -> tuple[Tensor, Tensor, Tensor]:
    check_device(*sources, query, norm_weight)  # before the stack (whose error would not name the routing)
    b, t, d = sources[0].shape
    out_PD, r_NP, lse_PH = _route_impl(torch.stack(sources).view(len(sources), b * t, d), query, norm_weight,
                                       heads, eps)
    return out_PD.view(b, t, d), r_NP, lse_PH


def _route_backward(sources: Tensor, r: Tensor, lse: Tensor, out: Tensor, query: Tensor, norm_weight: Tensor,
                    dout: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """(d sources [N, B, T, D], d query, d norm_weight) of route, from its saved inputs and outputs."""
    check_device(sources, r, lse, out, query, norm_weight, dout)
    n, b, t, d = sources.shape
    rows_NPD = sources.contiguous().view(n, b * t, d)
    acc_t, _ = accumulator(rows_NPD.dtype)
    q, g = query.detach().to(acc_t), norm_weight.detach().to(acc_t)
    dout_PD = dout.to(rows_NPD.dtype).contiguous().view(b * t, d)
    dsrc_NPD, a_D = _launch_backward(rows_NPD, r, (q * g).view(1, -1), lse, out.contiguous().view(b * t, d),
                                     dout_PD, heads)
    return dsrc_NPD.view(n, b, t, d), (a_D * g).to(query.dtype), (a_D * q).to(norm_weight.dtype)


@torch.library.custom_op("mhar_lit::route", mutates_args=())
def _route_op(sources: Tensor, query: Tensor, norm_weight: Tensor, heads: int,
              eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _route_stacked(sources, query, norm_weight, heads, eps)


@_route_op.register_fake
def _(sources, query, norm_weight, heads, eps):
    return _route_fake(sources.shape[0], sources, sources.dtype, heads)


@torch.library.custom_op("mhar_lit::route_list", mutates_args=())
def _route_list_op(sources: list[Tensor], query: Tensor, norm_weight: Tensor, heads: int,
                   eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _route_listed(sources, query, norm_weight, heads, eps)


@_route_list_op.register_fake
def _(sources, query, norm_weight, heads, eps):
    return _route_fake(len(sources), sources[0], stack_dtype(sources), heads)


@torch.library.custom_op("mhar_lit::route_backward", mutates_args=())
def _route_backward_op(sources: Tensor, r: Tensor, lse: Tensor, out: Tensor, query: Tensor, norm_weight: Tensor,
                       dout: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    return _route_backward(sources, r, lse, out, query, norm_weight, dout, heads)


@_route_backward_op.register_fake
def _(sources, r, lse, out, query, norm_weight, dout, heads):
    # contiguous, as the kernels write them (empty_like would copy the strides of a permuted input)
    return sources.new_empty(sources.shape), query.new_empty(query.shape), norm_weight.new_empty(norm_weight.shape)


def _save_route(ctx, inputs, output):
    """Setup of both entries. The list entry saves the sources it was given, not their stack: a caller that
    keeps its sources anyway (block and delta mode: the completed block sums) pays no saved copy per call
    (block mode at 350M saved ~1.9 GB of stacks); its backward stacks them again."""
    sources, query, norm_weight, heads, _ = inputs
    out, r, lse = output
    ctx.heads, ctx.listed = heads, isinstance(sources, (list, tuple))
    ctx.mark_non_differentiable(r, lse)
    ctx.save_for_backward(query, norm_weight, out, r, lse, *(sources if ctx.listed else [sources]))


def _route_grad(ctx, dout, _dr, _dlse, backward=None):
    query, norm_weight, out, r, lse, *sources = ctx.saved_tensors
    rows = torch.stack(sources) if ctx.listed else sources[0]
    dsrc, dq, dg = (backward or _route_backward_op)(rows, r, lse, out, query, norm_weight, dout, ctx.heads)
    if ctx.listed:
        dsrc = [dsrc[i].to(src.dtype) for i, src in enumerate(sources)]
    return dsrc, dq, dg, None, None


torch.library.register_autograd("mhar_lit::route", _route_grad, setup_context=_save_route)
torch.library.register_autograd("mhar_lit::route_list", _route_grad, setup_context=_save_route)


class _EagerRoute(torch.autograd.Function):
    """Both entries outside torch.compile: the custom ops' implementations, setup and backward without the
    dispatcher (module docstring). The sources come last and one by one, so that autograd tracks each of a list."""

    @staticmethod
    def forward(ctx, query, norm_weight, heads, eps, listed, *sources):
        inputs = (list(sources) if listed else sources[0], query, norm_weight, heads, eps)
        output = (_route_listed if listed else _route_stacked)(*inputs)
        _save_route(ctx, inputs, output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dr, dlse):
        dsrc, dq, dg, _, _ = _route_grad(ctx, dout, dr, dlse, backward=_route_backward)
        return dq, dg, None, None, None, *(dsrc if ctx.listed else [dsrc])


def _dispatch_route(sources, query: Tensor, norm_weight: Tensor, heads: int, eps: float) -> Tensor:
    """The custom op while torch.compile traces, the cheaper autograd.Function otherwise (same kernels)."""
    listed = isinstance(sources, list)
    if torch.compiler.is_compiling():
        return (_route_list_op if listed else _route_op)(sources, query, norm_weight, heads, eps)[0]
    return _EagerRoute.apply(query, norm_weight, heads, eps, listed, *(sources if listed else [sources]))[0]


def stack_dtype(sources: list[Tensor]) -> torch.dtype:
    """The dtype torch.stack gives the sources (mixed under autocast: fp32 embedding, bf16 outputs)."""
    dtype = sources[0].dtype
    for s in sources[1:]:
        dtype = torch.promote_types(dtype, s.dtype)
    return dtype


def _check_params(d: int, query: Tensor, norm_weight: Tensor, heads: int) -> None:
    if d % heads != 0:
        raise ValueError(f"hidden size {d} is not divisible by the number of routing heads {heads}")
    if query.shape != (d,) or norm_weight.shape != (d,):
        raise ValueError(f"query {tuple(query.shape)} and norm_weight {tuple(norm_weight.shape)} must be ({d},)")


def route_triton_list(sources: list[Tensor], query: Tensor, norm_weight: Tensor, heads: int,
                      eps: float = 1e-6) -> Tensor:
    """route_triton(torch.stack(sources), ...) without saving the stack for the backward (see
    _save_route); sources: N tensors [B, T, D] of one shape."""
    if not sources or any(s.shape != sources[0].shape or s.dim() != 3 for s in sources):
        raise ValueError(f"sources must be a non-empty list of [B, T, D] tensors of one shape, got "
                         f"{[tuple(s.shape) for s in sources]}")
    _check_params(sources[0].shape[-1], query, norm_weight, heads)
    check_storage_dtype(stack_dtype(sources))
    return _dispatch_route(list(sources), query, norm_weight, heads, eps)


def route_triton(sources: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float = 1e-6) -> Tensor:
    """Fused multi-head routing; sources [N, B, T, D], query and norm_weight [D] -> [B, T, D] (see module doc)."""
    if sources.dim() != 4:
        raise ValueError(f"sources must be [N, B, T, D], got shape {tuple(sources.shape)}")
    _check_params(sources.shape[-1], query, norm_weight, heads)
    check_storage_dtype(sources.dtype)
    return _dispatch_route(sources, query, norm_weight, heads, eps)
