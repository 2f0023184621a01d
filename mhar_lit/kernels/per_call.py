"""Triton kernels of the per-call routing op (routing_triton.py; used by delta mode): one site over a stack
of N source rows. Full-row programs holding a [BLOCK_T, H_P, K_P] tile take each row's RMS statistic
themselves and own the cross-head coupling term of the RMSNorm backward. Math: common.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mhar_lit.kernels.common import (_full_row_tile, _online_update, _pair_grads_per_head, _rsqrt_mean_square,
                                     _to_storage)


@triton.jit
def _pair_bwd(v, kr, r, dout, w_HK, lse, S):
    """One source row's pair: its gradient before the RMSNorm coupling, dl [BLOCK_T, H_P], the coupling
    sum_h dl logit [BLOCK_T], its A tile [H_P, K_P] (sum over tokens of dl kr) and alpha kr [BLOCK_T, H_P, K_P]
    (for the projection of the site's dl sum, _site_bwd_kernel)."""
    dv, dl, c_th, logit = _pair_grads_per_head(v, kr, r, dout, w_HK[None, :, :], lse, S)
    alpha_kr = tl.exp(logit - lse)[:, :, None] * kr
    return dv, dl, tl.sum(c_th, axis=1), tl.sum(dl[:, :, None] * kr, axis=0), alpha_kr


@triton.jit(do_not_specialize=["n_rows"])
def _site_fwd_kernel(
    rows_ptr, r_ptr, w_ptr, out_ptr, lse_ptr, n_rows, P, D, H, K, eps,
    BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr,
):
    """Per-call routing, full rows: online softmax over the rows [0, n_rows); each row's statistic is taken
    here and kept in r_ptr [N, P] for the backward; writes out and lse [P, H]."""
    offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th = _full_row_tile(P, D, H, K, BLOCK_T, H_P, K_P)
    row_stride = (tl.full([], 0, tl.int64) + P) * D  # int64: rows * P * D may pass 2^31
    store_ty = rows_ptr.dtype.element_ty

    w_HK = tl.load(w_ptr + col_HK, mask=mask_hk, other=0.0).to(ACC)
    m = tl.full([BLOCK_T, H_P], float("-inf"), ACC)
    l = tl.zeros([BLOCK_T, H_P], ACC)
    acc = tl.zeros([BLOCK_T, H_P, K_P], ACC)
    for n in range(0, n_rows):
        v = tl.load(rows_ptr + n * row_stride + tile, mask=mask, other=0.0).to(ACC)
        r = _rsqrt_mean_square(v, D, eps)
        tl.store(r_ptr + n * P + offs_t, r, mask=mask_t)
        m, l, acc = _online_update(v, r, w_HK, m, l, acc, store_ty)

    out = acc / l[:, :, None]
    tl.store(out_ptr + tile, _to_storage(out, out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + th, m + tl.log(l), mask=mask_th)


@triton.jit(do_not_specialize=["n_rows"])
def _site_bwd_kernel(
    rows_ptr, r_ptr, w_ptr, lse_ptr, dout_ptr, out_ptr, dsrc_ptr, a_ptr, n_rows, P, D, H, K,
    BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr,
):
    """Per-call routing backward, full rows: S = <dout, out> per head, then every source row's finished
    gradient dsrc[n] (storage dtype, written once) and this program's partial of A (summed over its tokens
    and the rows) into a[pid] (summed on the host in a fixed order). S comes from the output rounded to the
    storage dtype, so A takes dl with each token's dl sum sigma projected out (common._projected_dl): sum over
    rows and tokens of (dl - alpha sigma) kr = A - sum over tokens of sigma * (sum over rows of alpha kr), one
    more register tile and no extra reads."""
    pid = tl.program_id(0)
    offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th = _full_row_tile(P, D, H, K, BLOCK_T, H_P, K_P)
    row_stride = (tl.full([], 0, tl.int64) + P) * D  # int64: rows * P * D may pass 2^31
    store_ty = rows_ptr.dtype.element_ty

    dout = tl.load(dout_ptr + tile, mask=mask, other=0.0).to(ACC)
    S = tl.sum(dout * tl.load(out_ptr + tile, mask=mask, other=0.0).to(ACC), axis=2)
    w_HK = tl.load(w_ptr + col_HK, mask=mask_hk, other=0.0).to(ACC)
    lse = tl.load(lse_ptr + th, mask=mask_th, other=0.0)
    a = tl.zeros([H_P, K_P], ACC)
    sigma = tl.zeros([BLOCK_T, H_P], ACC)
    alpha_kr = tl.zeros([BLOCK_T, H_P, K_P], ACC)
    for n in range(0, n_rows):
        v = tl.load(rows_ptr + n * row_stride + tile, mask=mask, other=0.0).to(ACC)
        r = tl.load(r_ptr + n * P + offs_t, mask=mask_t, other=0.0).to(ACC)
        kr = _to_storage(v * r[:, None, None], store_ty).to(ACC)
        dv, dl, c, a_HK, alpha_kr_n = _pair_bwd(v, kr, r, dout, w_HK, lse, S)
        a += a_HK
        sigma += dl
        alpha_kr += alpha_kr_n
        dv -= (r * r * c / D)[:, None, None] * v
        tl.store(dsrc_ptr + n * row_stride + tile, _to_storage(dv, dsrc_ptr.dtype.element_ty), mask=mask)
    a -= tl.sum(sigma[:, :, None] * alpha_kr, axis=0)
    tl.store(a_ptr + pid * D + col_HK, a, mask=mask_hk)
