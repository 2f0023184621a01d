"""Triton kernels of full-mode routing, forward (full_routing.py; docs/method.md B, C, I).

`_append_kernel` writes a source into the shared buffer with its statistic; `_logits_kernel` writes its
logits against every later site into the pair table z [pairs, H, P] (tensor cores); `_prefix_fwd_kernel`
mixes the rows before a chunk into all of the chunk's sites, `_merge_fwd_kernel` adds each site's in-chunk
rows and writes its output and lse. Math: common.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mhar_lit.kernels.common import _mma, _mma_operand, _pair_row, _to_storage


@triton.jit(do_not_specialize=["row"])
def _append_kernel(new_ptr, rows_ptr, r_ptr, row, P, D, eps,
                   BLOCK_T: tl.constexpr, D_P: tl.constexpr, ACC: tl.constexpr):
    """Full mode: the source of site `row` enters the shared buffer: rows[row] = new, r[row] = its inverse
    RMS over the full width."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D_P)
    mask_t = offs_t < P
    mask = mask_t[:, None] & (offs_d[None, :] < D)
    tile = offs_t[:, None].to(tl.int64) * D + offs_d[None, :]
    row_off = (tl.full([], 0, tl.int64) + row) * P * D
    v_raw = tl.load(new_ptr + tile, mask=mask, other=0.0)
    tl.store(rows_ptr + row_off + tile, v_raw, mask=mask)
    v = v_raw.to(ACC)
    r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
    tl.store(r_ptr + row * P + offs_t, r, mask=mask_t)


@triton.jit(do_not_specialize=["src"])
def _logits_kernel(rows_ptr, r_ptr, w_hi_ptr, w_lo_ptr, z_ptr, src, N, P, D, H, K,
                   BLOCK_T: tl.constexpr, K_B: tl.constexpr, S_P: tl.constexpr, ACC: tl.constexpr,
                   PREC: tl.constexpr):
    """Logits of source `src` against every site s >= src, one head: z[(src, s), h, t] = <kr_[h], w_s,[h]>
    with kr = round_storage(v r), as a tensor-core product [BLOCK_T, K] @ [K, S] in K_B-wide slices
    (PREC "tf32x3": fp32-accurate; "ieee" for fp64; with bf16 storage kr is an exact bf16 operand and w
    two bf16 terms hi + lo, relative error ~2^-17; FullRouting.w_terms)."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_s = tl.arange(0, S_P)
    offs_b = tl.arange(0, K_B)
    mask_t = offs_t < P
    mask_s = src + offs_s < N
    row_off = (tl.full([], 0, tl.int64) + src) * P * D
    store_ty = rows_ptr.dtype.element_ty
    r = tl.load(r_ptr + src * P + offs_t, mask=mask_t, other=0.0).to(ACC)
    z = tl.zeros([BLOCK_T, S_P], ACC)
    for k0 in range(0, K, K_B):
        mask_b = k0 + offs_b < K
        col = h * K + k0 + offs_b
        v = tl.load(rows_ptr + row_off + offs_t[:, None].to(tl.int64) * D + col[None, :],
                    mask=mask_t[:, None] & mask_b[None, :], other=0.0).to(ACC)
        kr = _mma_operand(_to_storage(v * r[:, None], store_ty), store_ty, ACC)  # exact in the storage dtype
        w_off = (src + offs_s)[None, :] * D + col[:, None]
        mask_w = mask_b[:, None] & mask_s[None, :]
        w_hi = _mma_operand(tl.load(w_hi_ptr + w_off, mask=mask_w, other=0.0), store_ty, ACC)  # [K_B, S_P]
        z = _mma(kr, w_hi, z, store_ty, ACC, PREC)
        if store_ty == tl.bfloat16:  # kr is exact in bf16: two products carry w to ~2^-17
            w_lo = _mma_operand(tl.load(w_lo_ptr + w_off, mask=mask_w, other=0.0), store_ty, ACC)
            z = _mma(kr, w_lo, z, store_ty, ACC, PREC)
    pair = _pair_row(src, src + offs_s, N)
    tl.store(z_ptr + (pair[None, :] * H + h) * P + offs_t[:, None], z, mask=mask_t[:, None] & mask_s[None, :])


@triton.jit
def _prefix_logits(z_ptr, z_CT, mask_CT, n, n_rows, site_lo, N, H, P):
    """Logits [C_P, BLOCK_T] of row n against the chunk's sites; -inf past the last row (weight 0)."""
    return tl.load(z_ptr + _pair_row(n, site_lo, N) * H * P + z_CT, mask=mask_CT & (n < n_rows),
                   other=float("-inf"))


@triton.jit
def _prefix_row(rows_ptr, tile_TK, mask_TK, n, n_rows, row_stride):
    """Row n's head slice [BLOCK_T, K_P] in the storage dtype (zeros past the last row)."""
    return tl.load(rows_ptr + n * row_stride + tile_TK, mask=mask_TK & (n < n_rows), other=0.0)


@triton.jit
def _prefix_mix(z, v, m, l, acc, ACC: tl.constexpr):
    p = tl.exp(z - m)
    acc += p[:, :, None] * v.to(ACC)[None, :, :]
    return l + p, acc


@triton.jit(do_not_specialize=["n_rows", "site_lo", "n_sites"])
def _prefix_fwd_kernel(
    rows_ptr, z_ptr, m_ptr, l_ptr, acc_ptr,
    n_rows, site_lo, n_sites, N, P, D, H, K,
    C_P: tl.constexpr, BLOCK_T: tl.constexpr, K_W: tl.constexpr, ACC: tl.constexpr, UNROLL: tl.constexpr,
    R_B: tl.constexpr, STAGES: tl.constexpr,
):
    """Prefix pass of a chunk, one head and K_W of its columns: every row in [0, n_rows) is read once and
    mixed into the C sites [site_lo, site_lo + n_sites). The logits come from the pair table z (computed
    when each row entered), so a first loop over z alone fixes each site's max and the row loop is one FMA
    per element and site, with no rescaling. Writes each site's (m, l, acc) into slots 0..n_sites-1 (acc
    relative to m; m and l from the first column block). Column blocks (grid axis 2) let a head width that
    is no power of two run without padding: 160 = 5 x 32 instead of one 256-wide tile. One function: its two
    loops (the max over z, then the software-pipelined row loop) share the program's offsets and masks."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    k0 = tl.program_id(2) * K_W
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = k0 + tl.arange(0, K_W)
    offs_c = tl.arange(0, C_P)
    mask_t = offs_t < P
    mask_k = offs_k < K
    mask_c = offs_c < n_sites
    col = h * K + offs_k
    tile_TK = offs_t[:, None].to(tl.int64) * D + col[None, :]
    mask_TK = mask_t[:, None] & mask_k[None, :]
    mask_CT = mask_c[:, None] & mask_t[None, :]
    row_stride = (tl.full([], 0, tl.int64) + P) * D  # int64: rows * P * D may pass 2^31
    z_CT = (offs_c[:, None].to(tl.int64) * H + h) * P + offs_t[None, :]  # + pair (n, site_lo) rows

    # The max from z alone, R_B rows per step as one [C_P, BLOCK_T, R_B] tile: this loop carries no row data,
    # so a step costs one memory round trip; row by row it waited n_rows / UNROLL of them.
    offs_r = tl.arange(0, R_B)
    m = tl.full([C_P, BLOCK_T], float("-inf"), ACC)
    for n0 in range(0, n_rows, R_B):
        n = n0 + offs_r
        z = tl.load(z_ptr + _pair_row(n, site_lo, N)[None, None, :] * H * P + z_CT[:, :, None],
                    mask=mask_CT[:, :, None] & (n < n_rows)[None, None, :], other=float("-inf"))
        m = tl.maximum(m, tl.max(z, axis=2))
    m = tl.where(mask_CT, m, 0.0)  # padded sites/tokens: keep exp() finite
    l = tl.zeros([C_P, BLOCK_T], ACC)
    acc = tl.zeros([C_P, BLOCK_T, K_W], ACC)
    # UNROLL rows per step, their loads issued together: a program holds little data, so one row's load at
    # a time leaves the loop waiting on memory latency; masked rows (past n_rows) add exact zeros.
    # STAGES > 1: software-pipelined by Triton (the loads become asynchronous copies STAGES - 1 steps ahead)
    for n in tl.range(0, n_rows, UNROLL, num_stages=STAGES):
        z0 = _prefix_logits(z_ptr, z_CT, mask_CT, n, n_rows, site_lo, N, H, P)
        v0 = _prefix_row(rows_ptr, tile_TK, mask_TK, n, n_rows, row_stride)
        if UNROLL >= 2:
            z1 = _prefix_logits(z_ptr, z_CT, mask_CT, n + 1, n_rows, site_lo, N, H, P)
            v1 = _prefix_row(rows_ptr, tile_TK, mask_TK, n + 1, n_rows, row_stride)
        if UNROLL >= 4:
            z2 = _prefix_logits(z_ptr, z_CT, mask_CT, n + 2, n_rows, site_lo, N, H, P)
            v2 = _prefix_row(rows_ptr, tile_TK, mask_TK, n + 2, n_rows, row_stride)
            z3 = _prefix_logits(z_ptr, z_CT, mask_CT, n + 3, n_rows, site_lo, N, H, P)
            v3 = _prefix_row(rows_ptr, tile_TK, mask_TK, n + 3, n_rows, row_stride)
        l, acc = _prefix_mix(z0, v0, m, l, acc, ACC)
        if UNROLL >= 2:
            l, acc = _prefix_mix(z1, v1, m, l, acc, ACC)
        if UNROLL >= 4:
            l, acc = _prefix_mix(z2, v2, m, l, acc, ACC)
            l, acc = _prefix_mix(z3, v3, m, l, acc, ACC)

    ct = offs_c[:, None].to(tl.int64) * P + offs_t[None, :]
    tl.store(m_ptr + ct * H + h, m, mask=mask_CT & (k0 == 0))
    tl.store(l_ptr + ct * H + h, l, mask=mask_CT & (k0 == 0))
    acc_off = offs_c[:, None, None].to(tl.int64) * row_stride + tile_TK[None, :, :]
    tl.store(acc_ptr + acc_off, acc, mask=mask_CT[:, :, None] & mask_k[None, None, :])


@triton.jit(do_not_specialize=["row_lo", "site", "state_slot"])
def _merge_fwd_kernel(
    rows_ptr, z_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, lse_ptr,
    row_lo, site, state_slot, N, P, D, H, K,
    HAS_INIT: tl.constexpr, BLOCK_T: tl.constexpr, K_W: tl.constexpr, C_P: tl.constexpr, ACC: tl.constexpr,
):
    """Full mode, one site, head and K_W of its columns (as in _prefix_fwd_kernel): the prefix state
    (HAS_INIT) merged with the in-chunk rows [row_lo, site] by log-sum-exp, all logits from the pair table z.
    Writes out (storage) and lse [P, H] (from the first column block)."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    k0 = tl.program_id(2) * K_W
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = k0 + tl.arange(0, K_W)
    mask_t = offs_t < P
    mask_k = offs_k < K
    col = h * K + offs_k
    tile_TK = offs_t[:, None].to(tl.int64) * D + col[None, :]
    mask_TK = mask_t[:, None] & mask_k[None, :]
    row_stride = (tl.full([], 0, tl.int64) + P) * D  # int64: rows * P * D may pass 2^31
    z_T = h * P + offs_t

    if HAS_INIT:
        th = (state_slot * P + offs_t) * H + h
        m0 = tl.load(m_ptr + th, mask=mask_t, other=0.0).to(ACC)
        l0 = tl.load(l_ptr + th, mask=mask_t, other=0.0).to(ACC)
        acc0 = tl.load(acc_ptr + state_slot * row_stride + tile_TK, mask=mask_TK, other=0.0).to(ACC)
        m = m0
    else:
        m = tl.full([BLOCK_T], float("-inf"), ACC)
    # the in-chunk rows [row_lo, site] as one [BLOCK_T, C_P, K_W] tile: their loads are issued together
    n = row_lo + tl.arange(0, C_P)
    mask_tc = mask_t[:, None] & (n <= site)[None, :]
    z = tl.load(z_ptr + _pair_row(n, site, N)[None, :] * H * P + z_T[:, None], mask=mask_tc, other=float("-inf"))
    v = tl.load(rows_ptr + n[None, :, None] * row_stride + tile_TK[:, None, :],
                mask=mask_tc[:, :, None] & mask_TK[:, None, :], other=0.0).to(ACC)
    m = tl.maximum(m, tl.max(z, axis=1))
    m = tl.where(mask_t, m, 0.0)  # padded tokens: keep exp() finite
    p = tl.exp(z - m[:, None])  # 0 for the masked rows
    if HAS_INIT:
        scale = tl.exp(m0 - m)
        l = l0 * scale + tl.sum(p, axis=1)
        acc = acc0 * scale[:, None] + tl.sum(p[:, :, None] * v, axis=1)
    else:
        l = tl.sum(p, axis=1)
        acc = tl.sum(p[:, :, None] * v, axis=1)
    l = tl.where(mask_t, l, 1.0)  # padded tokens: keep log() and the division finite
    out = acc / l[:, None]
    tl.store(out_ptr + tile_TK, _to_storage(out, out_ptr.dtype.element_ty), mask=mask_TK)
    tl.store(lse_ptr + (site * P + offs_t) * H + h, m + tl.log(l), mask=mask_t & (k0 == 0))
