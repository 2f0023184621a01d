"""Pure tensor math of the query probe (docs/method.md G). No model, no I/O: every function is testable by hand.

Shape legend: N sources, B sequences, T positions, D width, P parts (heads or slices), S sites, R draws.
All routing math mirrors mhar_lit.routing (keys = cast(S_n * r(S_n)) * g with r over the FULL width,
logits without temperature) and runs in the compute dtype (fp32, or fp64 for fp64 inputs).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from mhar_lit.routing import compute_dtype, routing_keys  # noqa: F401  (routing_keys re-exported for the probe)


def slice_logits(keys_NBTD: Tensor, query_D: Tensor, parts: int) -> Tensor:
    """Per-part logits <q_[p], k_n,[p]> [N, B, T, P]; parts = H gives MHAR heads, parts = S the probe slices.

    Summing over the last axis gives the full-width logit <q, k_n> (the single-head routing logit).
    """
    n, b, t, d = keys_NBTD.shape
    if d % parts != 0:
        raise ValueError(f"width {d} is not divisible by {parts} slices/heads")
    q_PK = query_D.to(keys_NBTD.dtype).view(parts, d // parts)
    return (keys_NBTD.view(n, b, t, parts, d // parts) * q_PK).sum(-1)


def head_weights(keys_NBTD: Tensor, query_D: Tensor, heads: int) -> Tensor:
    """Routing weights alpha^(h) [N, B, T, H]: one softmax over depth per head."""
    return slice_logits(keys_NBTD, query_D, heads).softmax(dim=0)


def width_disagreement_kl(keys_NBTD: Tensor, query_D: Tensor, slices: int) -> Tensor:
    """Mean over slices of KL(a_s || alpha) per token [B, T] (docs/method.md G).

    a_s = softmax_n <q_[s], k_n,[s]> and alpha = softmax_n <q, k_n>; since <q, k_n> = sum_s <q_[s], k_n,[s]>
    the shared logits are the sum of the slice logits, so both come from one einsum. Log-softmax keeps
    the KL finite when a slice puts (numerically) all its mass on one source.
    """
    logits_NBTS = slice_logits(keys_NBTD, query_D, slices)
    log_a = logits_NBTS.log_softmax(dim=0)
    log_alpha = logits_NBTS.sum(-1, keepdim=True).log_softmax(dim=0)
    kl_BTS = (log_a.exp() * (log_a - log_alpha)).sum(0)
    return kl_BTS.mean(-1)


def matched_norm_queries(query_SD: Tensor, heads: int, draws: int, generator: torch.Generator) -> Tensor:
    """Random queries q~ [R, S, D] with ||q~_[h]|| = ||q_[h]|| for every site and head slice (docs/method.md G,
    the null).

    z ~ N(0, I) on the CPU generator (so draws are identical on any device), direction z/||z|| per head
    slice, scaled to the trained slice norm. heads = 1 matches the norm per site over the full width.
    """
    sites, d = query_SD.shape
    if d % heads != 0:
        raise ValueError(f"width {d} is not divisible by {heads} heads")
    q = query_SD.detach().to("cpu", torch.float64).view(sites, heads, d // heads)
    z = torch.randn(draws, sites, heads, d // heads, generator=generator, dtype=torch.float64)
    direction = z / z.norm(dim=-1, keepdim=True)
    null = direction * q.norm(dim=-1, keepdim=True)
    return null.view(draws, sites, d).to(query_SD.dtype)


def mean_pairwise_cosine(sources_NBTD: Tensor, eps: float = 1e-12) -> Tensor:
    """Mean over pairs i < j of cos(S_i, S_j) per token [B, T]; scale-free, so raw sources are fine.

    A zero source (e.g. a zero-initialised null source) has cosine 0 with everything rather than NaN.
    """
    n = sources_NBTD.shape[0]
    if n < 2:
        raise ValueError("pairwise cosine needs at least two sources")
    v = sources_NBTD.to(compute_dtype(sources_NBTD.dtype))
    unit = v / v.norm(dim=-1, keepdim=True).clamp_min(eps)
    gram_BTNN = torch.einsum("ibtd,jbtd->btij", unit, unit)
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool, device=v.device), diagonal=1)
    return gram_BTNN[..., upper].mean(-1)


def head_deviation(mean_weights_NH: Tensor) -> Tensor:
    """Delta_{h,n} = wbar_{h,n} - (1/H) sum_h wbar_{h,n}, returned as [N, H] like its input."""
    return mean_weights_NH - mean_weights_NH.mean(dim=-1, keepdim=True)


def pearson(x: Tensor, y: Tensor) -> Optional[float]:
    """Pearson correlation of two equally long flat vectors; None when either is constant (undefined)."""
    x, y = x.flatten().double(), y.flatten().double()
    if x.numel() != y.numel() or x.numel() < 2:
        raise ValueError(f"pearson needs two vectors of equal length >= 2, got {x.numel()} and {y.numel()}")
    xc, yc = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float((xc * xc).sum()) * float((yc * yc).sum()))
    if denominator == 0.0:
        return None
    return float((xc * yc).sum()) / denominator
