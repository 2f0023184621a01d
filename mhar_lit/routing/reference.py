"""The PyTorch reference of depth routing: the math every kernel is tested against.

route(sources, query, norm_weight, heads) mixes N source rows per position with H independent softmaxes
over depth (docs/method.md B and C):

    k_n        = round_storage(S_n * r(S_n)) * g          r = rsqrt(mean_d S_n^2 + eps), over the FULL width d
    logit[n,h] = < q_[h], k_n,[h] >                         no temperature
    alpha[.,h] = softmax_n logit[., h]                      H softmaxes, one per head slice
    out_[h]    = sum_n alpha[n,h] * S_n,[h]                 values are the unnormalised sources

Logits, softmax and accumulation run in fp32 (or fp64 for fp64 inputs) whatever the storage dtype; the
result is cast back to the storage dtype. H = 1 is single-head attention residuals (Kimi).

"""

from __future__ import annotations

import torch
from torch import Tensor

def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every storage dtype below fp32, fp64 stays fp64 (for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def check_heads(width: int, heads: int) -> None:
    if heads < 1:
        raise ValueError(f"routing heads must be >= 1, got {heads}")
    if width % heads != 0:
        raise ValueError(f"hidden size {width} is not divisible by the number of routing heads {heads}")


def check_route_args(sources: Tensor, query: Tensor, norm_weight: Tensor, heads: int) -> None:
    if sources.dim() != 4:
        raise ValueError(f"sources must be [N, B, T, D], got shape {tuple(sources.shape)}")
    if sources.shape[0] < 1:
        raise ValueError("route needs at least one source (N >= 1)")
    width = sources.shape[-1]
    if query.shape != (width,) or norm_weight.shape != (width,):
        raise ValueError(
            f"query {tuple(query.shape)} and norm_weight {tuple(norm_weight.shape)} must both be ({width},)"
        )
    check_heads(width, heads)


def normalized_sources(sources: Tensor, eps: float = 1e-6) -> Tensor:
    """round_storage(S r(S)) [..., D] in the compute dtype: the keys before the norm weight g."""
    ctype = compute_dtype(sources.dtype)
    v = sources.to(ctype)
    inv_rms = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return (v * inv_rms).to(sources.dtype).to(ctype)


def routing_keys(sources: Tensor, norm_weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Keys k_n = round_storage(S_n r(S_n)) * g [N, B, T, D] in the compute dtype; r over the FULL width."""
    normed = normalized_sources(sources, eps)
    return normed * norm_weight.to(normed.dtype)


def routing_logits(sources: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float = 1e-6) -> Tensor:
    """Raw routing logits [N, B, T, H] in the compute dtype (reference math, see module docstring)."""
    n, b, t, d = sources.shape
    keys = routing_keys(sources, norm_weight, eps)
    q_HK = query.to(keys.dtype).view(heads, d // heads)
    return (keys.view(n, b, t, heads, d // heads) * q_HK).sum(-1)


def routing_weights(sources: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float = 1e-6) -> Tensor:
    """Softmax-over-depth weights alpha [N, B, T, H] (compute dtype); used by monitors and the probe."""
    check_route_args(sources, query, norm_weight, heads)
    return routing_logits(sources, query, norm_weight, heads, eps).softmax(dim=0)


def route_reference(sources: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float = 1e-6) -> Tensor:
    """Eager PyTorch routing; autograd does the backward. Ground truth for every other backend."""
    n, b, t, d = sources.shape
    weights_NBTH = routing_logits(sources, query, norm_weight, heads, eps).softmax(dim=0)
    values = sources.to(weights_NBTH.dtype).view(n, b, t, heads, d // heads)
    mixed_BTHK = (weights_NBTH.unsqueeze(-1) * values).sum(0)
    return mixed_BTHK.reshape(b, t, d).to(sources.dtype)


def block_mix(blocks: Tensor, queries: Tensor, norm_weights: Tensor, heads: int, eps: float = 1e-6
              ) -> tuple[Tensor, Tensor, Tensor]:
    """Phase 1 of Kimi's two-phase block routing (docs/method.md D): every site of a block against its completed blocks.

    blocks [K, B, T, D] (the embedding and the completed block sums), queries and norm_weights [S, D] of the
    block's S sites. Each completed block is normalised once (not once per site) and the sites' g is folded into
    q (w = q g; exact up to fp32 rounding order, docs/method.md J15). Returns, per site and head, the softmax state over
    the completed blocks: max m [S, B, T, H], sum of exponentials l [S, B, T, H] and the normalised mix
    o [S, B, T, D], all in the compute dtype (fp32 for bf16 storage).
    """
    with torch.autocast(blocks.device.type, enabled=False):  # autocast would run the einsums in bf16
        return _block_mix(blocks, queries, norm_weights, heads, eps)


def _block_mix(blocks: Tensor, queries: Tensor, norm_weights: Tensor, heads: int, eps: float
               ) -> tuple[Tensor, Tensor, Tensor]:
    k, b, t, d = blocks.shape
    normed = normalized_sources(blocks, eps).view(k, b, t, heads, d // heads)
    w_SHK = (queries.to(normed.dtype) * norm_weights.to(normed.dtype)).view(-1, heads, d // heads)
    logits = torch.einsum("kbthc,shc->skbth", normed, w_SHK)
    m = logits.amax(dim=1)
    e = torch.exp(logits - m.unsqueeze(1))
    l = e.sum(dim=1)  # noqa: E741
    values = blocks.to(normed.dtype).view(k, b, t, heads, d // heads)
    o = torch.einsum("skbth,kbthc->sbthc", e, values) / l.unsqueeze(-1)
    return m, l, o.reshape(-1, b, t, d)


def merge_partial(m: Tensor, l: Tensor, o: Tensor, partial: Tensor, query: Tensor, norm_weight: Tensor,  # noqa: E741
                  heads: int, eps: float = 1e-6) -> Tensor:
    """Phase 2 (docs/method.md D): one site's mix over the completed blocks (m, l, o [B, T, H / D] of block_mix) merged
    with the block's partial sum p [B, T, D] by the online-softmax rule, per head; returns [B, T, D] in the
    compute dtype (the caller casts to the storage dtype once).

        lam = < w_[h], round(p r(p))_[h] >,  m' = max(m, lam)
        out = (e^(m - m') l o + e^(lam - m') p) / (e^(m - m') l + e^(lam - m'))
    """
    with torch.autocast(partial.device.type, enabled=False):
        return _merge_partial(m, l, o, partial, query, norm_weight, heads, eps)


def _merge_partial(m: Tensor, l: Tensor, o: Tensor, partial: Tensor, query: Tensor, norm_weight: Tensor,  # noqa: E741
                   heads: int, eps: float) -> Tensor:
    b, t, d = partial.shape
    normed = normalized_sources(partial, eps).view(b, t, heads, d // heads)
    w_HK = (query.to(normed.dtype) * norm_weight.to(normed.dtype)).view(heads, d // heads)
    lam = (normed * w_HK).sum(-1)
    top = torch.maximum(m, lam)
    old, new = torch.exp(m - top) * l, torch.exp(lam - top)
    values = partial.to(normed.dtype).view(b, t, heads, d // heads)
    mixed = (old.unsqueeze(-1) * o.view(b, t, heads, d // heads) + new.unsqueeze(-1) * values)
    return (mixed / (old + new).unsqueeze(-1)).reshape(b, t, d)
