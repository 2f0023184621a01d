"""Triton kernels of full-mode routing while decoding (mhar_lit.generation.routing.DecodeFullRouter): one launch
to add a source and one to route a site, where the PyTorch decode router takes about ten small kernels per site.
A decode step routes one token per row, so its time is the number of kernels the captured step replays, not
bytes: on an H100 a 350M model with full MHAR (49 sites) decoded at 0.65x the standard residual's speed with the
PyTorch decode router (benchmarks/results/speed_probe_2026-12-07).

    add(y, slot):  values[slot] = y;  keys[slot] = round_storage(y r(y)),  r = rsqrt(mean y^2 + eps) over the row
    route(site):   logit[n, h] = < keys[n]_[h], w_[h] >  (fp32),  out_[h] = sum_n softmax_n(logit)[n, h] values[n]_[h]

The softmax is online over blocks of sources (fp32 state), so the result equals the PyTorch router's up to fp32
rounding order, before the one rounding to the storage dtype. Keys are F.rms_norm's up to the fp32 rounding of
1 / sqrt (compiled, Triton's sqrt and division are not correctly rounded): at times one storage ulp apart. No
tensor-core products (the problem is a dot product per source and head): the kernels take any head width and any
number of rows and sources.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from mhar_lit.kernels.common import _to_storage
from mhar_lit.kernels.host import pow2

SOURCE_BLOCK = 16  # sources per step of the online softmax
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["slot"])
def _add_kernel(y_ptr, values_ptr, keys_ptr, slot, P, D, eps, BLOCK_D: tl.constexpr):
    """One row: the source y and its normalised key into the pass's buffers at `slot`."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    y = tl.load(y_ptr + row.to(tl.int64) * D + offs, mask=mask, other=0.0)
    y32 = y.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(y32 * y32, axis=0) / D + eps)
    at = (tl.full([], 0, tl.int64) + slot) * P * D + row.to(tl.int64) * D + offs
    tl.store(values_ptr + at, y, mask=mask)
    tl.store(keys_ptr + at, _to_storage(y32 * rstd, keys_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n"])
def _route_kernel(values_ptr, keys_ptr, w_ptr, g_ptr, out_ptr, n, P, D, K,
                  BLOCK_N: tl.constexpr, K_P: tl.constexpr, HAS_G: tl.constexpr):
    """One (row, head): the softmax over the first n sources of its logits, and their mix. The head's query is
    w, or w g in fp32 where HAS_G (a query and its key-norm weight as given: nothing computed before the launch)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_k = tl.arange(0, K_P)
    mask_k = offs_k < K
    col = row.to(tl.int64) * D + head * K + offs_k
    w = tl.load(w_ptr + head * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    if HAS_G:
        w = w * tl.load(g_ptr + head * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([K_P], tl.float32)
    for n0 in range(0, n, BLOCK_N):
        src = n0 + tl.arange(0, BLOCK_N)
        mask_n = src < n
        at = src.to(tl.int64)[:, None] * P * D + col[None, :]
        mask = mask_n[:, None] & mask_k[None, :]
        keys = tl.load(keys_ptr + at, mask=mask, other=0.0).to(tl.float32)
        logit = tl.where(mask_n, tl.sum(keys * w[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m, tl.max(logit, axis=0))
        scale = tl.exp(m - m_new)
        p = tl.exp(logit - m_new)  # 0 for the sources past n
        values = tl.load(values_ptr + at, mask=mask, other=0.0).to(tl.float32)
        acc = acc * scale + tl.sum(p[:, None] * values, axis=0)
        l = l * scale + tl.sum(p, axis=0)
        m = m_new
    tl.store(out_ptr + col, _to_storage(acc / l, out_ptr.dtype.element_ty), mask=mask_k)


def add(y_BTD: Tensor, values: Tensor, keys: Tensor, slot: int, eps: float) -> None:
    """values[slot] = y and keys[slot] = its normalised row (values, keys: [sites, B, T, D], y's dtype)."""
    y = y_BTD.contiguous()
    rows, width = y.numel() // y.shape[-1], y.shape[-1]
    _add_kernel[(rows,)](y, values, keys, slot, rows, width, eps, BLOCK_D=pow2(width))


def route(values: Tensor, keys: Tensor, w_HK: Tensor, n: int, g_HK: Optional[Tensor] = None) -> Tensor:
    """The mix [B, T, D] of the first n sources of values [sites, B, T, D] (contiguous) under the site's query
    w [H, K] (contiguous; times the key-norm weight g [H, K] in fp32 when given): per head, a softmax over the
    sources of < key, w >."""
    heads, head_width = w_HK.shape
    _, b, t, d = values.shape
    out = values.new_empty((b, t, d))
    _route_kernel[(b * t, heads)](values, keys, w_HK, w_HK if g_HK is None else g_HK, out, n, b * t, d, head_width,
                                  BLOCK_N=SOURCE_BLOCK, K_P=pow2(head_width), HAS_G=g_HK is not None)
    return out
