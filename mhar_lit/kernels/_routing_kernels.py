"""Triton kernels for multi-head depth routing (math: mhar_lit/routing.py, SPEC B, C, I).

Layout. Every routed tensor is a stack of rows [rows, P, D] with P = B*T positions, row-major, contiguous.
Head h owns columns [h*K, (h+1)*K), K = D/H. Tiles are padded to powers of two (K_P, H_P) and masked.

Per-call path (`_site_fwd_kernel`, `_site_bwd_kernel`; routing_triton.py, used by block and delta modes):
full-row programs holding a [BLOCK_T, H_P, K_P] tile take each row's RMS statistic themselves and own the
cross-head coupling term of the RMSNorm backward.

Full-mode path (full_routing.py): `_append_kernel` writes a source into the shared buffer with its
statistic; `_logits_kernel` writes its logits against every later site into the pair table z [pairs, H, P]
(tensor cores); `_prefix_fwd_kernel` and `_merge_fwd_kernel` mix rows with the logits from z; backward:
`_suffix_bwd_kernel` (one read of a group's rows and of every later dout), then per source either
`_column_row_bwd_kernel` (full rows: in-group pairs, key path and coupling in one pass) or, per head,
`_column_bwd_kernel` (in-group pairs) and `_keypath_kernel`; `_query_grad_kernel` (tensor-core contractions
over sites and tokens).

Math per (site s, source n, position, head h), with w = q_s * g_s folded in the compute dtype ACC:
    kr      = round_storage(v_n * r_n)                  the reference's key rounding, before g
    logit   = <kr_[h], w_[h]>
    alpha   = exp(logit - lse_s)                        lse saved by the forward: [P, H] per site
    gdot    = <dout_s,[h], v_n,[h]>;  S_s = <dout_s,[h], out_s,[h]>
    dl      = alpha * (gdot - S_s)                      softmax backward
    dv_n   += alpha * dout_s + r_n * dl * w             value path + per-head key path
    c_n    += dl * logit                                coupling, summed over heads before use:
    dv_n   -= r_n^2 / D * (sum_h c_n) * v_n             RMSNorm backward through r (rounding as identity)
    A_s    += dl * kr                                   then dq_s = A_s * g_s, dg_s = A_s * q_s (host)

No atomics: A is written as per-program partials and reduced on the host in a fixed order.
ACC is a constexpr (tl.float32, or tl.float64 so that float64 gradcheck runs in the interpreter).
Row and site indices are not specialised (do_not_specialize): Triton would otherwise compile a kernel per
index class (== 1, divisible by 16, other) and per combination of them, so a cold start compiled dozens of
copies of each kernel; the offsets derived from them stay aligned through the specialised strides.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# The interpreter converts fp32 -> bf16 by truncation (GPUs round to nearest even); emulate the hardware's
# rounding there so that interpreter tests see the numerics the GPU produces. Read at decoration time, like
# TRITON_INTERPRET itself.
SOFTWARE_BF16_ROUNDING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _to_storage(x, ty: tl.constexpr):
    """x rounded to the storage dtype `ty` (round to nearest even, also in the interpreter)."""
    if SOFTWARE_BF16_ROUNDING:
        if ty == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            y = bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
        else:
            y = x.to(ty)
    else:
        y = x.to(ty)
    return y


@triton.jit
def _rsqrt_mean_square(v, D, eps):
    """Per-token inverse RMS of a [BLOCK_T, H_P, K_P] tile over the full width D."""
    sq = tl.sum(tl.sum(v * v, axis=2), axis=1)
    return 1.0 / tl.sqrt(sq / D + eps)


@triton.jit
def _full_row_tile(P, D, H, K, BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr):
    """This program's [BLOCK_T, H_P, K_P] tile of full rows: offsets into a [P, D] row and masks."""
    return _full_row_tile_at(tl.program_id(0), P, D, H, K, BLOCK_T, H_P, K_P)


@triton.jit
def _full_row_tile_at(tile_id, P, D, H, K, BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr):
    """_full_row_tile of token tile `tile_id` (programs that map their id to a tile and something else)."""
    offs_t = tile_id * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, H_P)
    offs_k = tl.arange(0, K_P)
    mask_t = offs_t < P
    mask_hk = (offs_h[:, None] < H) & (offs_k[None, :] < K)
    col_HK = offs_h[:, None] * K + offs_k[None, :]
    tile = offs_t[:, None, None].to(tl.int64) * D + col_HK[None, :, :]
    mask = mask_t[:, None, None] & mask_hk[None, :, :]
    th = offs_t[:, None].to(tl.int64) * H + offs_h[None, :]
    mask_th = mask_t[:, None] & (offs_h[None, :] < H)
    return offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th


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


@triton.jit
def _online_update(v, r, w_HK, m, l, acc, store_ty: tl.constexpr):
    """Fold one source row (full-row tile) into the running softmax state of one site."""
    kr = _to_storage(v * r[:, None, None], store_ty).to(v.dtype)
    logit = tl.sum(kr * w_HK[None, :, :], axis=2)  # [BLOCK_T, H_P]
    m_new = tl.maximum(m, logit)
    scale = tl.exp(m - m_new)
    p = tl.exp(logit - m_new)
    l = l * scale + p
    acc = acc * scale[:, :, None] + p[:, :, None] * v
    return m_new, l, acc


@triton.jit
def _pair_row(src, site, N):
    """Row of the pair (source src, site >= src) in the source-major triangular pair table of N sites:
    source j owns the N - j consecutive rows of sites j..N-1, starting at j*N - j*(j-1)/2."""
    j = tl.full([], 0, tl.int64) + src  # int64; src may be a scalar, a loop index or a vector
    return j * N - (j * (j - 1)) // 2 + (site - j)


@triton.jit
def _dout_rows(dout_ptrs_ptr, s, ok, store_ty: tl.constexpr):
    """The [P, D] dout of site(s) s (a scalar or a vector) as pointers, from a backward's table of the douts
    autograd delivered (FullRouting and BlockRouting keep those tensors alive instead of copying them into a
    buffer); null where not ok (such lanes must stay masked)."""
    rows = tl.load(dout_ptrs_ptr + s, mask=ok, other=0).to(tl.pointer_type(store_ty))
    return tl.multiple_of(rows, 16)  # the routing classes enter only 16-byte aligned douts (vector loads)


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
def _prefix_row(rows_ptr, tile_TK, mask_TK, n, n_rows, row_stride, ROW_3D: tl.constexpr):
    """Row n's head slice in the storage dtype (zeros past the last row): [BLOCK_T, K_P], or with ROW_3D
    [1, BLOCK_T, K_P], loaded with the shape it is mixed in. (sm_90 TTGIR, 2026-12-05: a [BLOCK_T, K_P] row is
    converted into the accumulator's layout through shared memory, 512 fp32 per row at 100M; loaded 3-D, only
    the [C_P, BLOCK_T] weights are: the loop's shared-memory stores 32 -> 8 per step, 148 -> 126 registers.)"""
    if ROW_3D:  # a constexpr branch: one of the two is compiled
        v = tl.load(rows_ptr + n * row_stride + tile_TK[None, :, :], mask=mask_TK[None, :, :] & (n < n_rows),
                    other=0.0)
    else:
        v = tl.load(rows_ptr + n * row_stride + tile_TK, mask=mask_TK & (n < n_rows), other=0.0)
    return v


@triton.jit
def _prefix_mix(z, v, m, l, acc, ACC: tl.constexpr, ROW_3D: tl.constexpr):
    p = tl.exp(z - m)
    if ROW_3D:
        acc += p[:, :, None] * v.to(ACC)
    else:
        acc += p[:, :, None] * v.to(ACC)[None, :, :]
    return l + p, acc


@triton.jit(do_not_specialize=["n_rows", "site_lo", "n_sites"])
def _prefix_fwd_kernel(
    rows_ptr, z_ptr, m_ptr, l_ptr, acc_ptr,
    n_rows, site_lo, n_sites, N, P, D, H, K,
    C_P: tl.constexpr, BLOCK_T: tl.constexpr, K_W: tl.constexpr, ACC: tl.constexpr, UNROLL: tl.constexpr,
    R_B: tl.constexpr, STAGES: tl.constexpr, ROW_3D: tl.constexpr,
):
    """Prefix pass of a chunk, one head and K_W of its columns: every row in [0, n_rows) is read once and
    mixed into the C sites [site_lo, site_lo + n_sites). The logits come from the pair table z (computed
    when each row entered), so a first loop over z alone fixes each site's max and the row loop is one FMA
    per element and site, with no rescaling. Writes each site's (m, l, acc) into slots 0..n_sites-1 (acc
    relative to m; m and l from the first column block). Column blocks (grid axis 2) let a head width that
    is no power of two run without padding: 160 = 5 x 32 instead of one 256-wide tile."""
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
        v0 = _prefix_row(rows_ptr, tile_TK, mask_TK, n, n_rows, row_stride, ROW_3D)
        if UNROLL >= 2:
            z1 = _prefix_logits(z_ptr, z_CT, mask_CT, n + 1, n_rows, site_lo, N, H, P)
            v1 = _prefix_row(rows_ptr, tile_TK, mask_TK, n + 1, n_rows, row_stride, ROW_3D)
        if UNROLL >= 4:
            z2 = _prefix_logits(z_ptr, z_CT, mask_CT, n + 2, n_rows, site_lo, N, H, P)
            v2 = _prefix_row(rows_ptr, tile_TK, mask_TK, n + 2, n_rows, row_stride, ROW_3D)
            z3 = _prefix_logits(z_ptr, z_CT, mask_CT, n + 3, n_rows, site_lo, N, H, P)
            v3 = _prefix_row(rows_ptr, tile_TK, mask_TK, n + 3, n_rows, row_stride, ROW_3D)
        l, acc = _prefix_mix(z0, v0, m, l, acc, ACC, ROW_3D)
        if UNROLL >= 2:
            l, acc = _prefix_mix(z1, v1, m, l, acc, ACC, ROW_3D)
        if UNROLL >= 4:
            l, acc = _prefix_mix(z2, v2, m, l, acc, ACC, ROW_3D)
            l, acc = _prefix_mix(z3, v3, m, l, acc, ACC, ROW_3D)

    ct = offs_c[:, None].to(tl.int64) * P + offs_t[None, :]
    tl.store(m_ptr + ct * H + h, m, mask=mask_CT & (k0 == 0))
    tl.store(l_ptr + ct * H + h, l, mask=mask_CT & (k0 == 0))
    acc_off = offs_c[:, None, None].to(tl.int64) * row_stride + tile_TK[None, :, :]
    tl.store(acc_ptr + acc_off, acc, mask=mask_CT[:, :, None] & mask_k[None, None, :])


@triton.jit(do_not_specialize=["n_rows", "site_lo", "n_sites"])
def _prefix_dot_fwd_kernel(
    rows_ptr, z_ptr, m_ptr, l_ptr, acc_ptr,
    n_rows, site_lo, n_sites, N, P, D, H, K,
    C_P: tl.constexpr, BLOCK_T: tl.constexpr, K_A: tl.constexpr, K_B: tl.constexpr, R_B: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr,
):
    """The prefix pass of _prefix_fwd_kernel (same inputs and outputs) on tensor cores: per token and head the
    mix is a small matrix product, acc [C, K] += p [C, R] @ v [R, K] over blocks of R_B rows, run batched over
    the program's BLOCK_T tokens (C_P and R_B >= 16). A step loads R_B rows at once. Head columns in two
    slices K_A + K_B as in _suffix_dot_bwd_kernel."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, C_P)
    offs_r = tl.arange(0, R_B)
    mask_t = offs_t < P
    mask_tc = mask_t[:, None] & (offs_c < n_sites)[None, :]
    row_stride = (tl.full([], 0, tl.int64) + P) * D  # int64: rows * P * D may pass 2^31
    store_ty = rows_ptr.dtype.element_ty
    tok_a, mk_a = _head_slice(offs_t, h, K, D, 0, K_A)
    if K_B > 0:
        tok_b, mk_b = _head_slice(offs_t, h, K, D, K_A, K_B)
    # logit of (row n, site site_lo + c): a source's pairs are consecutive rows from pair (n, site_lo)
    z_tc = (offs_c[None, :, None].to(tl.int64) * H + h) * P + offs_t[:, None, None]  # [BLOCK_T, C_P, 1]

    m = tl.full([BLOCK_T, C_P], float("-inf"), ACC)
    for n0 in range(0, n_rows, R_B):  # the max first (from z alone), so the mix needs no rescaling
        n = n0 + offs_r
        z = tl.load(z_ptr + _pair_row(n, site_lo, N)[None, None, :] * H * P + z_tc,
                    mask=mask_tc[:, :, None] & (n < n_rows)[None, None, :], other=float("-inf"))
        m = tl.maximum(m, tl.max(z, axis=2))
    m = tl.where(mask_tc, m, 0.0)  # padded sites/tokens: keep exp() finite
    l = tl.zeros([BLOCK_T, C_P], ACC)
    acc_a = tl.zeros([BLOCK_T, C_P, K_A], ACC)
    if K_B > 0:
        acc_b = tl.zeros([BLOCK_T, C_P, K_B], ACC)
    for n0 in range(0, n_rows, R_B):
        n = n0 + offs_r
        ok = n < n_rows
        z = tl.load(z_ptr + _pair_row(n, site_lo, N)[None, None, :] * H * P + z_tc,
                    mask=mask_tc[:, :, None] & ok[None, None, :], other=float("-inf"))
        p = tl.exp(z - m[:, :, None])  # [BLOCK_T, C_P, R_B], 0 past the last row
        l += tl.sum(p, axis=2)
        n_off = n[None, :, None].to(tl.int64) * row_stride
        mask_tn = mask_t[:, None, None] & ok[None, :, None]
        v_a = tl.load(rows_ptr + n_off + tok_a, mask=mask_tn & mk_a, other=0.0)  # [BLOCK_T, R_B, K_A]
        acc_a = _mma_weights(p, _mma_operand(v_a, store_ty, ACC), acc_a, store_ty, ACC, PREC)
        if K_B > 0:
            v_b = tl.load(rows_ptr + n_off + tok_b, mask=mask_tn & mk_b, other=0.0)
            acc_b = _mma_weights(p, _mma_operand(v_b, store_ty, ACC), acc_b, store_ty, ACC, PREC)

    ct = (offs_c[None, :].to(tl.int64) * P + offs_t[:, None]) * H + h
    tl.store(m_ptr + ct, m, mask=mask_tc)
    tl.store(l_ptr + ct, l, mask=mask_tc)
    c_off = offs_c[None, :, None].to(tl.int64) * row_stride
    tl.store(acc_ptr + c_off + tok_a, acc_a, mask=mask_tc[:, :, None] & mk_a)
    if K_B > 0:
        tl.store(acc_ptr + c_off + tok_b, acc_b, mask=mask_tc[:, :, None] & mk_b)


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


@triton.jit
def _site_w(w_ptr, w_lo_ptr, base, col, mask, col_HK, mask_hk, ACC: tl.constexpr, W_TILE: tl.constexpr,
            SPLIT_W: tl.constexpr):
    """A site's w = q g (its row starts at `base`), broadcastable to the [BLOCK_T, H_P, K_P] row tile.
    W_TILE: loaded as a full tile (`col`, `mask`: the tile's column offsets and mask; the same row for every
    token) in the rows' dtype, so that it arrives in the register layout of the rows and douts; with bf16
    rows (SPLIT_W) as two parts w = hi + lo (routing_triton.split_w). Else a [1, H_P, K_P] load of the fp32 w
    (`col_HK`, `mask_hk`), which Triton converts into the rows' layout through shared memory with two
    barriers (sm_90 TTGIR and SASS, 2026-12-05): a loop that loads w per site pays them per site."""
    if W_TILE:
        w = tl.load(w_ptr + base + col, mask=mask, other=0.0).to(ACC)
        if SPLIT_W:
            w += tl.load(w_lo_ptr + base + col, mask=mask, other=0.0).to(ACC)
    else:
        w = tl.load(w_ptr + base + col_HK, mask=mask_hk, other=0.0).to(ACC)[None, :, :]
    return w


@triton.jit
def _dl_buffer(BLOCK_T: tl.constexpr, H_P: tl.constexpr, SLOTS_P: tl.constexpr, ACC: tl.constexpr):
    """(slot index [1, 1, SLOTS_P], zero buffer [BLOCK_T, H_P, SLOTS_P]) for a loop's pairs' dl, kept in
    registers and stored once after the loop: a store of a reduced [BLOCK_T, H_P] tensor is a layout conversion
    through shared memory with two barriers, one per pair in the loop. SLOTS_P = 0: no buffer (placeholders)."""
    if SLOTS_P > 0:
        slots = tl.arange(0, SLOTS_P)[None, None, :]
        dls = tl.zeros([BLOCK_T, H_P, SLOTS_P], ACC)
    else:
        slots = 0
        dls = 0.0
    return slots, dls


@triton.jit
def _keep_dl(dls, slots, slot, dl, ptrs, mask, SLOTS_P: tl.constexpr):
    """A pair's dl [BLOCK_T, H_P]: into slot `slot` of the buffer (SLOTS_P > 0, _dl_buffer), else stored now."""
    if SLOTS_P > 0:
        dls = tl.where(slots == slot, dl[:, :, None], dls)
    else:
        tl.store(ptrs, dl, mask=mask)
    return dls


@triton.jit
def _pair_grads(v, kr, r, dout, w_HK, lse, S):
    """One (site, source) pair on full-row tiles: the source gradient before the RMSNorm coupling (value path +
    per-head key path: alpha dout + r dl w), the pair's dl [BLOCK_T, H_P] and its coupling sum_h dl logit
    [BLOCK_T]."""
    dv, dl, c_th = _pair_grads_per_head(v, kr, r, dout, w_HK[None, :, :], lse, S)
    return dv, dl, tl.sum(c_th, axis=1)


@triton.jit
def _pair_grads_per_head(v, kr, r, dout, w, lse, S):
    """_pair_grads with the coupling per head, dl logit [BLOCK_T, H_P], not yet summed over the heads (a sum
    that crosses warps: a loop over pairs sums it once, after the loop). w: the site's w_HK as [1, H_P, K_P]
    or as a full [BLOCK_T, H_P, K_P] tile (_site_w)."""
    logit = tl.sum(kr * w, axis=2)  # [BLOCK_T, H_P]
    alpha = tl.exp(logit - lse)
    dl = alpha * (tl.sum(dout * v, axis=2) - S)
    dv = alpha[:, :, None] * dout + (dl * r[:, None])[:, :, None] * w
    return dv, dl, dl * logit


@triton.jit
def _pair_bwd(v, kr, r, dout, w_HK, lse, S):
    """_pair_grads with the pair's A tile [H_P, K_P] (sum over tokens of dl kr) in place of dl."""
    dv, dl, c = _pair_grads(v, kr, r, dout, w_HK, lse, S)
    return dv, c, tl.sum(dl[:, :, None] * kr, axis=0)


@triton.jit(do_not_specialize=["n_rows"])
def _site_bwd_kernel(
    rows_ptr, r_ptr, w_ptr, lse_ptr, dout_ptr, out_ptr, dsrc_ptr, a_ptr, n_rows, P, D, H, K,
    BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr,
):
    """Per-call routing backward, full rows: S = <dout, out> per head, then every source row's finished
    gradient dsrc[n] (storage dtype, written once) and this program's partial of A (summed over its tokens
    and the rows) into a[pid] (summed on the host in a fixed order)."""
    pid = tl.program_id(0)
    offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th = _full_row_tile(P, D, H, K, BLOCK_T, H_P, K_P)
    row_stride = (tl.full([], 0, tl.int64) + P) * D  # int64: rows * P * D may pass 2^31
    store_ty = rows_ptr.dtype.element_ty

    dout = tl.load(dout_ptr + tile, mask=mask, other=0.0).to(ACC)
    S = tl.sum(dout * tl.load(out_ptr + tile, mask=mask, other=0.0).to(ACC), axis=2)
    w_HK = tl.load(w_ptr + col_HK, mask=mask_hk, other=0.0).to(ACC)
    lse = tl.load(lse_ptr + th, mask=mask_th, other=0.0)
    a = tl.zeros([H_P, K_P], ACC)
    for n in range(0, n_rows):
        v = tl.load(rows_ptr + n * row_stride + tile, mask=mask, other=0.0).to(ACC)
        r = tl.load(r_ptr + n * P + offs_t, mask=mask_t, other=0.0).to(ACC)
        kr = _to_storage(v * r[:, None, None], store_ty).to(ACC)
        dv, c, a_HK = _pair_bwd(v, kr, r, dout, w_HK, lse, S)
        a += a_HK
        dv -= (r * r * c / D)[:, None, None] * v
        tl.store(dsrc_ptr + n * row_stride + tile, _to_storage(dv, dsrc_ptr.dtype.element_ty), mask=mask)
    tl.store(a_ptr + pid * D + col_HK, a, mask=mask_hk)


@triton.jit
def _suffix_loads(dout_ptrs_ptr, lse_ptr, S_ptr, z_ptr, z_GT, mask_GT, tile_TK, mask_TK, offs_t, mask_t,
                  s, s_lo, s_hi, P, H, h, store_ty: tl.constexpr):
    """Everything the suffix pass reads of site s: dout (storage dtype), the lse and S of its tokens, the
    logits of the group's pairs (-inf when s >= s_hi) and their offset in the pair table."""
    ok = s < s_hi
    dout = tl.load(_dout_rows(dout_ptrs_ptr, s, ok, store_ty) + tile_TK, mask=mask_TK & ok, other=0.0)
    lse = tl.load(lse_ptr + (s * P + offs_t) * H + h, mask=mask_t & ok, other=0.0)
    S = tl.load(S_ptr + (s * P + offs_t) * H + h, mask=mask_t & ok, other=0.0)
    z_off = z_GT + (s - s_lo) * H * P  # a source's pairs are consecutive rows
    logit = tl.load(z_ptr + z_off, mask=mask_GT & ok, other=float("-inf"))
    return dout, logit - lse[None, :], S, z_off


@triton.jit
def _suffix_pair(v, dout, shifted_logit, S, dl_ptr, z_off, mask_store, dv, ACC: tl.constexpr):
    """One later site against the group's rows: store dl of its pairs, return dv plus the value path."""
    dout = dout.to(ACC)
    alpha = tl.exp(shifted_logit)
    gdot = tl.sum(v * dout[None, :, :], axis=2)
    tl.store(dl_ptr + z_off, alpha * (gdot - S[None, :]), mask=mask_store)
    return dv + alpha[:, :, None] * dout[None, :, :]


@triton.jit(do_not_specialize=["n_lo", "n_src", "s_lo"])
def _suffix_bwd_kernel(
    rows_ptr, lse_ptr, S_ptr, dout_ptrs_ptr, z_ptr, dl_ptr, part_dv_ptr,
    n_lo, n_src, s_lo, s_hi, N, P, D, H, K,
    G_P: tl.constexpr, BLOCK_T: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr, UNROLL: tl.constexpr,
):
    """Full-mode suffix pass of a source group, one head: the group's rows [n_lo, n_lo + n_src) stay in
    registers while every later site [s_lo, s_hi) is read once. Per pair it needs only the forward's logit
    (pair table z) and the site's lse and S, so the loop is one K-reduction (gdot) and one FMA (value path)
    per element: it writes the pair's softmax gradient dl into dl [pairs, H, P] (the key path and dq/dg
    are finished later from dl, off the O(L^2) row traffic) and the group's value-path partial dv.
    (A version that also accumulated the RMSNorm coupling sum_s dl * logit here, a loop-carried
    [G, BLOCK_T] tile, ran 2-2.5x slower on an H200 at 100M/350M; the column kernel takes it from dl and z.)"""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, K_P)
    offs_g = tl.arange(0, G_P)
    mask_t = offs_t < P
    mask_k = offs_k < K
    mask_g = offs_g < n_src
    col = h * K + offs_k
    tile_TK = offs_t[:, None].to(tl.int64) * D + col[None, :]
    mask_TK = mask_t[:, None] & mask_k[None, :]
    row_stride = (tl.full([], 0, tl.int64) + P) * D  # int64: rows * P * D may pass 2^31
    store_ty = rows_ptr.dtype.element_ty

    mask_GT = mask_g[:, None] & mask_t[None, :]
    mask_GTK = mask_GT[:, :, None] & mask_k[None, None, :]
    rows_GTK = (n_lo + offs_g)[:, None, None].to(tl.int64) * row_stride + tile_TK[None, :, :]
    v = tl.load(rows_ptr + rows_GTK, mask=mask_GTK, other=0.0).to(ACC)
    z_GT = (_pair_row(n_lo + offs_g, s_lo, N)[:, None] * H + h) * P + offs_t[None, :]  # pair (g, s_lo)
    dv = tl.zeros([G_P, BLOCK_T, K_P], ACC)
    # UNROLL later sites per step with their loads issued together (see _prefix_fwd_kernel); sites past
    # s_hi load logits of -inf, so their alpha, dl and value-path terms are exact zeros.
    for s in range(s_lo, s_hi, UNROLL):
        d0, a0, S0, o0 = _suffix_loads(dout_ptrs_ptr, lse_ptr, S_ptr, z_ptr, z_GT, mask_GT, tile_TK, mask_TK,
                                       offs_t, mask_t, s, s_lo, s_hi, P, H, h, store_ty)
        if UNROLL >= 2:
            d1, a1, S1, o1 = _suffix_loads(dout_ptrs_ptr, lse_ptr, S_ptr, z_ptr, z_GT, mask_GT, tile_TK, mask_TK,
                                           offs_t, mask_t, s + 1, s_lo, s_hi, P, H, h, store_ty)
        if UNROLL >= 4:
            d2, a2, S2, o2 = _suffix_loads(dout_ptrs_ptr, lse_ptr, S_ptr, z_ptr, z_GT, mask_GT, tile_TK, mask_TK,
                                           offs_t, mask_t, s + 2, s_lo, s_hi, P, H, h, store_ty)
            d3, a3, S3, o3 = _suffix_loads(dout_ptrs_ptr, lse_ptr, S_ptr, z_ptr, z_GT, mask_GT, tile_TK, mask_TK,
                                           offs_t, mask_t, s + 3, s_lo, s_hi, P, H, h, store_ty)
        dv = _suffix_pair(v, d0, a0, S0, dl_ptr, o0, mask_GT & (s < s_hi), dv, ACC)
        if UNROLL >= 2:
            dv = _suffix_pair(v, d1, a1, S1, dl_ptr, o1, mask_GT & (s + 1 < s_hi), dv, ACC)
        if UNROLL >= 4:
            dv = _suffix_pair(v, d2, a2, S2, dl_ptr, o2, mask_GT & (s + 2 < s_hi), dv, ACC)
            dv = _suffix_pair(v, d3, a3, S3, dl_ptr, o3, mask_GT & (s + 3 < s_hi), dv, ACC)

    part_GTK = offs_g[:, None, None].to(tl.int64) * row_stride + tile_TK[None, :, :]
    tl.store(part_dv_ptr + part_GTK, dv, mask=mask_GTK)


@triton.jit
def _mma_operand(x, store_ty: tl.constexpr, ACC: tl.constexpr):
    """x as a tensor-core operand: bf16 storage stays bf16 (exact products, fp32 sums); fp32/fp64 storage in
    the compute dtype. The interpreter's bf16 dot is wrong (Triton 3.8), so it gets the same values in fp32."""
    if store_ty == tl.bfloat16:
        if SOFTWARE_BF16_ROUNDING:
            y = x.to(tl.float32)
        else:
            y = x.to(tl.bfloat16)
    else:
        y = x.to(ACC)
    return y


@triton.jit
def _mma(a, b, acc, store_ty: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """acc + a @ b for operands prepared by _mma_operand (bf16 ones need no input precision)."""
    if store_ty == tl.bfloat16:
        out = tl.dot(a, b, acc, out_dtype=tl.float32)
    else:
        out = tl.dot(a, b, acc, input_precision=PREC, out_dtype=ACC)
    return out


@triton.jit
def _mma_weights(alpha, b, acc, store_ty: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """acc + alpha @ b with fp32 weights alpha: for bf16 operands b, alpha is split into two bf16 terms
    (hi + lo, relative error <= 2^-17 against the bf16 rounding of the result's 2^-9); otherwise PREC."""
    if store_ty == tl.bfloat16:
        hi = _to_storage(alpha, tl.bfloat16)
        lo = _to_storage(alpha - hi.to(tl.float32), tl.bfloat16)
        out = _mma(_mma_operand(hi, store_ty, ACC), b, acc, store_ty, ACC, PREC)
        out = _mma(_mma_operand(lo, store_ty, ACC), b, out, store_ty, ACC, PREC)
    else:
        out = _mma(alpha.to(ACC), b, acc, store_ty, ACC, PREC)
    return out


@triton.jit
def _head_slice(offs_t, h, K, D, k0, KW: tl.constexpr):
    """Offsets [BLOCK_T, 1, KW] of head h's columns [k0, k0 + KW) in a [P, D] row, and their mask (< K)."""
    offs_k = k0 + tl.arange(0, KW)
    tok = (offs_t.to(tl.int64) * D)[:, None, None] + (h * K + offs_k)[None, None, :]
    return tok, (offs_k < K)[None, None, :]


@triton.jit(do_not_specialize=["n_lo", "n_src", "s_lo"])
def _suffix_dot_bwd_kernel(
    rows_ptr, lse_ptr, S_ptr, dout_ptrs_ptr, z_ptr, dl_ptr, part_dv_ptr,
    n_lo, n_src, s_lo, s_hi, N, P, D, H, K,
    r_ptr, w_hi_ptr, w_lo_ptr, part_c_ptr,
    G_P: tl.constexpr, BLOCK_T: tl.constexpr, K_A: tl.constexpr, K_B: tl.constexpr, S_B: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr, KEYPATH: tl.constexpr,
):
    """The suffix pass of _suffix_bwd_kernel (same inputs and outputs) on tensor cores. Per token and head it
    is two small matrix products: gdot [G, S] = V [G, K] @ dout^T [K, S] and dv [G, K] += alpha [G, S] @
    dout [S, K]; a program runs them batched over its BLOCK_T tokens for S_B later sites per step (G_P and
    S_B >= 16, the products' smallest size). So a step loads S_B sites' dout at once instead of one, and the
    per-element work leaves the CUDA cores. The head's K columns are two power-of-two slices K_A + K_B
    (K_B = 0: one slice) so that K = 160 is 128 + 32 wide, not padded to 256.

    KEYPATH (for the full-row column kernel): the pairs' key path joins the value path in part_dv, as a third
    product per token, dv [G, K] += (r dl) [G, S] @ w [S, K] (w = q g of the later sites, _mma_split), and
    their share of the RMSNorm coupling, sum over the later sites of dl * logit, goes to part_c [G, P, H]. The
    column kernel then adds both and reads no suffix pair."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_g = tl.arange(0, G_P)
    offs_s = tl.arange(0, S_B)
    mask_t = offs_t < P
    mask_g = offs_g < n_src
    row_stride = (tl.full([], 0, tl.int64) + P) * D  # int64: rows * P * D may pass 2^31
    store_ty = rows_ptr.dtype.element_ty
    tok_a, mk_a = _head_slice(offs_t, h, K, D, 0, K_A)
    if K_B > 0:
        tok_b, mk_b = _head_slice(offs_t, h, K, D, K_A, K_B)

    # the group's rows [BLOCK_T, G_P, K], one read
    g_off = (n_lo + offs_g)[None, :, None].to(tl.int64) * row_stride
    mask_tg = mask_t[:, None, None] & mask_g[None, :, None]
    v_a = _mma_operand(tl.load(rows_ptr + g_off + tok_a, mask=mask_tg & mk_a, other=0.0), store_ty, ACC)
    dv_a = tl.zeros([BLOCK_T, G_P, K_A], ACC)
    if K_B > 0:
        v_b = _mma_operand(tl.load(rows_ptr + g_off + tok_b, mask=mask_tg & mk_b, other=0.0), store_ty, ACC)
        dv_b = tl.zeros([BLOCK_T, G_P, K_B], ACC)
    pair_g = _pair_row(n_lo + offs_g, s_lo, N)  # [G_P]: pair (g, s_lo); pair (g, s) is s - s_lo rows on
    if KEYPATH:
        c_tg = tl.zeros([BLOCK_T, G_P], ACC)
        r_tg = tl.load(r_ptr + (n_lo + offs_g)[None, :].to(tl.int64) * P + offs_t[:, None],
                       mask=mask_t[:, None] & mask_g[None, :], other=0.0).to(ACC)  # [BLOCK_T, G_P]
    for s0 in range(s_lo, s_hi, S_B):
        s = s0 + offs_s
        ok_s = s < s_hi
        s_rows = _dout_rows(dout_ptrs_ptr, s, ok_s, store_ty)[None, :, None]
        mask_ts3 = mask_t[:, None, None] & ok_s[None, :, None]
        dout_a = _mma_operand(tl.load(s_rows + tok_a, mask=mask_ts3 & mk_a, other=0.0),
                              store_ty, ACC)  # [BLOCK_T, S_B, K_A]
        gdot = _mma(v_a, tl.permute(dout_a, (0, 2, 1)), tl.zeros([BLOCK_T, G_P, S_B], ACC), store_ty, ACC, PREC)
        if K_B > 0:
            dout_b = _mma_operand(tl.load(s_rows + tok_b, mask=mask_ts3 & mk_b, other=0.0),
                                  store_ty, ACC)
            gdot = _mma(v_b, tl.permute(dout_b, (0, 2, 1)), gdot, store_ty, ACC, PREC)
        ts = (s[None, :].to(tl.int64) * P + offs_t[:, None]) * H + h  # [BLOCK_T, S_B] of the [N, P, H] tensors
        mask_ts = mask_t[:, None] & ok_s[None, :]
        lse = tl.load(lse_ptr + ts, mask=mask_ts, other=0.0)
        S = tl.load(S_ptr + ts, mask=mask_ts, other=0.0)
        z_off = ((pair_g[None, :, None] + (s - s_lo)[None, None, :]) * H + h) * P + offs_t[:, None, None]
        mask_z = mask_ts[:, None, :] & mask_g[None, :, None]
        logit = tl.load(z_ptr + z_off, mask=mask_z, other=float("-inf"))
        alpha = tl.exp(logit - lse[:, None, :])  # [T, G, S]
        dl = alpha * (gdot - S[:, None, :])
        tl.store(dl_ptr + z_off, dl, mask=mask_z)
        dv_a = _mma_weights(alpha, dout_a, dv_a, store_ty, ACC, PREC)
        if K_B > 0:
            dv_b = _mma_weights(alpha, dout_b, dv_b, store_ty, ACC, PREC)
        if KEYPATH:
            c_tg += tl.sum(dl * tl.where(mask_z, logit, 0.0), axis=2)  # masked logits are -inf (dl 0 there)
            dlr_hi, dlr_lo = _bf16_split(dl * r_tg[:, :, None], store_ty, ACC)
            dv_a = _suffix_keypath(dlr_hi, dlr_lo, w_hi_ptr, w_lo_ptr, s, ok_s, h, K, D, 0, dv_a, BLOCK_T, S_B, K_A,
                                   store_ty, ACC, PREC)
            if K_B > 0:
                dv_b = _suffix_keypath(dlr_hi, dlr_lo, w_hi_ptr, w_lo_ptr, s, ok_s, h, K, D, K_A, dv_b, BLOCK_T, S_B,
                                       K_B, store_ty, ACC, PREC)

    part_off = offs_g[None, :, None].to(tl.int64) * row_stride
    tl.store(part_dv_ptr + part_off + tok_a, dv_a, mask=mask_tg & mk_a)
    if K_B > 0:
        tl.store(part_dv_ptr + part_off + tok_b, dv_b, mask=mask_tg & mk_b)
    if KEYPATH:
        tl.store(part_c_ptr + (offs_g[None, :].to(tl.int64) * P + offs_t[:, None]) * H + h, c_tg,
                 mask=mask_t[:, None] & mask_g[None, :])


@triton.jit
def _suffix_keypath(dl_hi, dl_lo, w_hi_ptr, w_lo_ptr, s, ok_s, h, K, D, k0, dv, BLOCK_T: tl.constexpr,
                    S_B: tl.constexpr, KW: tl.constexpr, store_ty: tl.constexpr, ACC: tl.constexpr,
                    PREC: tl.constexpr):
    """dv [BLOCK_T, G, KW] + (r dl) [BLOCK_T, G, S_B] @ w [S_B, KW] (r dl as _bf16_split terms) for head h's
    columns [k0, k0 + KW) of the sites s (w = q g, FullRouting.w_terms; the same for every token, broadcast over
    the batch of tokens)."""
    offs_k = k0 + tl.arange(0, KW)
    w_off = s[:, None].to(tl.int64) * D + (h * K + offs_k)[None, :]
    mask_w = ok_s[:, None] & (offs_k < K)[None, :]
    w_hi = tl.broadcast_to(tl.load(w_hi_ptr + w_off, mask=mask_w, other=0.0)[None, :, :], (BLOCK_T, S_B, KW))
    if store_ty == tl.bfloat16:  # the second term of w exists only for bf16 storage
        w_lo = tl.broadcast_to(tl.load(w_lo_ptr + w_off, mask=mask_w, other=0.0)[None, :, :], (BLOCK_T, S_B, KW))
    else:
        w_lo = w_hi
    return _mma_split(dl_hi, dl_lo, _mma_operand(w_hi, store_ty, ACC), _mma_operand(w_lo, store_ty, ACC), dv,
                      store_ty, ACC, PREC)


@triton.jit
def _in_group_loads(dout_ptrs_ptr, S_ptr, z_ptr, lse_ptr, s0, g_end, pair0, src, offs_j, tile, mask, mask_t, th, zt,
                    P, H, store_ty: tl.constexpr):
    """Loads of the in-group sites s0 .. s0 + J_B - 1 (< g_end) for the column's source: dout [BLOCK_T, J_B,
    K_P] (storage dtype), S, logit and lse [BLOCK_T, J_B] (masked lanes: zeros)."""
    s = s0 + offs_j
    mask_tj = mask_t[:, None] & (s < g_end)[None, :]
    douts = tl.load(_dout_rows(dout_ptrs_ptr, s, s < g_end, store_ty)[None, :, None] + tile[:, None, :],
                    mask=mask_tj[:, :, None] & mask[:, None, :], other=0.0)
    tj = s[None, :].to(tl.int64) * P * H + th[:, None]
    S_j = tl.load(S_ptr + tj, mask=mask_tj, other=0.0)
    logit_j = tl.load(z_ptr + (pair0 + s - src)[None, :].to(tl.int64) * H * P + zt[:, None], mask=mask_tj, other=0.0)
    lse_j = tl.load(lse_ptr + tj, mask=mask_tj, other=0.0)
    return douts, S_j, logit_j, lse_j


@triton.jit(do_not_specialize=["src", "g_end", "part_slot", "dout_addr"])
def _column_bwd_kernel(
    rows_ptr, lse_ptr, S_ptr, dout_ptrs_ptr, dout_new_ptr, out_new_ptr,
    z_ptr, dl_ptr, part_dv_ptr, dvp_ptr, c_ptr,
    src, g_end, part_slot, N, P, D, H, K, dout_addr,
    HAS_SUFFIX: tl.constexpr, BLOCK_T: tl.constexpr, K_P: tl.constexpr, S_P: tl.constexpr, J_B: tl.constexpr,
    ACC: tl.constexpr,
):
    """Full-mode backward of site `src`, one head: everything of source `src` but its key path.

    The new site's dout arrives (dout_new, at address dout_addr: the first program enters it into the table
    dout_ptrs for the later passes; S = <dout, out> of this head is taken here and appended to S). The pairs
    (s, src) for in-group sites s in [src, g_end) are computed here (value path, dl stored); the pairs
    s >= g_end came from the suffix pass (part_dv, dl).
    Writes the value-path gradient dvp [P, D] (fp32) and this head's share of the RMSNorm coupling
    c [H, P] (sum over pairs of dl * logit); _keypath_kernel adds the key path and writes the gradient.

    Every load is issued before the first store: a store may alias a later load for the compiler, so each
    store would make the loads after it wait for a new memory round trip. The in-group sites come J_B per
    step, the next step's loads issued before this step's store of dl."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, K_P)
    offs_j = tl.arange(0, J_B)
    mask_t = offs_t < P
    col = h * K + offs_k
    tile = offs_t[:, None].to(tl.int64) * D + col[None, :]
    mask = mask_t[:, None] & (offs_k[None, :] < K)
    th = offs_t.to(tl.int64) * H + h  # [N, P, H] tensors (lse, S)
    zt = h * P + offs_t.to(tl.int64)  # [pairs, H, P] tensors (z, dl)
    row_stride = (tl.full([], 0, tl.int64) + P) * D  # int64: rows * P * D may pass 2^31
    pair0 = _pair_row(src, src, N)

    dout_raw = tl.load(dout_new_ptr + tile, mask=mask, other=0.0)
    out_new = tl.load(out_new_ptr + tile, mask=mask, other=0.0)
    v = tl.load(rows_ptr + src * row_stride + tile, mask=mask, other=0.0).to(ACC)
    logit = tl.load(z_ptr + pair0 * H * P + zt, mask=mask_t, other=0.0)
    lse = tl.load(lse_ptr + src * P * H + th, mask=mask_t, other=0.0)
    if HAS_SUFFIX:
        part_dv = tl.load(part_dv_ptr + part_slot * row_stride + tile, mask=mask, other=0.0).to(ACC)
        # the suffix pairs' dl and logits as one [BLOCK_T, sites] tile, not a loop over sites
        offs_s = g_end + tl.arange(0, S_P)
        zts = (pair0 + offs_s - src)[None, :] * H * P + zt[:, None]
        mask_ts = mask_t[:, None] & (offs_s[None, :] < N)
        dl_s = tl.load(dl_ptr + zts, mask=mask_ts, other=0.0)
        z_s = tl.load(z_ptr + zts, mask=mask_ts, other=0.0)
    store_ty = rows_ptr.dtype.element_ty
    douts, S_j, logit_j, lse_j = _in_group_loads(dout_ptrs_ptr, S_ptr, z_ptr, lse_ptr, src + 1, g_end, pair0, src,
                                                 offs_j, tile, mask, mask_t, th, zt, P, H, store_ty)

    dout = dout_raw.to(ACC)
    S = tl.sum(dout * out_new.to(ACC), axis=1)
    alpha = tl.exp(logit - lse)
    dl = alpha * (tl.sum(dout * v, axis=1) - S)
    dv = alpha[:, None] * dout
    c = dl * logit
    if HAS_SUFFIX:
        dv += part_dv
        c += tl.sum(dl_s * z_s, axis=1)
    if (pid_t == 0) & (h == 0):
        tl.store(dout_ptrs_ptr + src, dout_addr)
    tl.store(S_ptr + src * P * H + th, S, mask=mask_t)
    tl.store(dl_ptr + pair0 * H * P + zt, dl, mask=mask_t)
    # in-group sites (their dout in the table, their S in the buffer), J_B per step as one [BLOCK_T, J_B, K_P]
    # tile; each step's loads were issued one step ahead (_in_group_loads), before the previous dl store
    for s0 in range(src + 1, g_end, J_B):
        s = s0 + offs_j
        mask_tj = mask_t[:, None] & (s < g_end)[None, :]
        alpha_j = tl.where(mask_tj, tl.exp(logit_j - lse_j), 0.0)
        dl_j = alpha_j * (tl.sum(douts.to(ACC) * v[:, None, :], axis=2) - S_j)
        dv += tl.sum(alpha_j[:, :, None] * douts.to(ACC), axis=1)
        c += tl.sum(dl_j * logit_j, axis=1)
        zj = (pair0 + s - src)[None, :].to(tl.int64) * H * P + zt[:, None]
        douts, S_j, logit_j, lse_j = _in_group_loads(dout_ptrs_ptr, S_ptr, z_ptr, lse_ptr, s0 + J_B, g_end, pair0,
                                                     src, offs_j, tile, mask, mask_t, th, zt, P, H, store_ty)
        tl.store(dl_ptr + zj, dl_j, mask=mask_tj)
    tl.store(dvp_ptr + tile, dv, mask=mask)
    tl.store(c_ptr + zt, c, mask=mask_t)


@triton.jit
def _row_site_loads(dout_ptrs_ptr, S_ptr, z_ptr, lse_ptr, w_ptr, w_lo_ptr, s, g_end, pair0, src, tile, mask, th, zth,
                    mask_th, col, col_HK, mask_hk, P, D, H, store_ty: tl.constexpr, ACC: tl.constexpr,
                    W_TILE: tl.constexpr, SPLIT_W: tl.constexpr):
    """What the full-row column kernel reads of in-group site s (< g_end, else zeros): dout [BLOCK_T, H_P, K_P]
    (storage dtype), S, logit and lse [BLOCK_T, H_P], and w_s = q_s g_s (_site_w)."""
    ok = s < g_end
    dout = tl.load(_dout_rows(dout_ptrs_ptr, s, ok, store_ty) + tile, mask=mask & ok, other=0.0)
    S = tl.load(S_ptr + s * P * H + th, mask=mask_th & ok, other=0.0)
    logit = tl.load(z_ptr + (pair0 + s - src) * H * P + zth, mask=mask_th & ok, other=0.0)
    lse = tl.load(lse_ptr + s * P * H + th, mask=mask_th & ok, other=0.0)
    w = _site_w(w_ptr, w_lo_ptr, s * D, col, mask & ok, col_HK, mask_hk & ok, ACC, W_TILE, SPLIT_W)
    return dout, S, logit, lse, w


@triton.jit
def _row_suffix_loads(dl_ptr, z_ptr, w_ptr, w_lo_ptr, s, pair0, src, N, zth, mask_th, col, mask, col_HK, mask_hk, P,
                      D, H, ACC: tl.constexpr, W_TILE: tl.constexpr, SPLIT_W: tl.constexpr):
    """A suffix pair (s, src), s >= g_end, of the full-row column kernel: its dl and logit [BLOCK_T, H_P] (from
    the suffix pass and the forward) and w_s (_site_w); zeros for s >= N."""
    ok = s < N
    off = (pair0 + s - src) * H * P + zth
    dl = tl.load(dl_ptr + off, mask=mask_th & ok, other=0.0)
    logit = tl.load(z_ptr + off, mask=mask_th & ok, other=0.0)
    w = _site_w(w_ptr, w_lo_ptr, s * D, col, mask & ok, col_HK, mask_hk & ok, ACC, W_TILE, SPLIT_W)
    return dl, logit, w


@triton.jit
def _row_pair(dout, S, logit, lse, w, v_raw, r, mask_th, dv, c, ACC: tl.constexpr):
    """One pair (s, src) of the full-row column kernel: its dl [BLOCK_T, H_P], and dv, c plus its value and key
    path and its coupling term."""
    d_s = dout.to(ACC)
    alpha = tl.where(mask_th, tl.exp(logit - lse), 0.0)
    dl = alpha * (tl.sum(d_s * v_raw.to(ACC), axis=2) - S)
    dv += alpha[:, :, None] * d_s + (dl * r[:, None])[:, :, None] * w
    return dl, dv, c + dl * logit


@triton.jit(do_not_specialize=["src", "g_end", "part_slot", "dout_addr"])
def _column_row_bwd_kernel(
    rows_ptr, r_ptr, w_ptr, w_lo_ptr, lse_ptr, S_ptr, dout_ptrs_ptr, dout_new_ptr, out_new_ptr,
    z_ptr, dl_ptr, part_dv_ptr, part_c_ptr, dsrc_ptr,
    src, g_end, part_slot, N, P, D, H, K, dout_addr,
    HAS_SUFFIX: tl.constexpr, SUFFIX_KEYS: tl.constexpr, BLOCK_T: tl.constexpr, H_P: tl.constexpr,
    K_P: tl.constexpr, ACC: tl.constexpr, W_TILE: tl.constexpr, SPLIT_W: tl.constexpr, G_P: tl.constexpr,
):
    """Full-mode backward of site `src` on full rows (every head of a token block in one program): the work of
    _column_bwd_kernel and _keypath_kernel in one pass, so the fp32 value-path gradient and the coupling never
    go through memory. The RMSNorm coupling sums over heads, which is why per-head programs need two kernels.

    Per pair (s, src), head h: alpha = exp(logit - lse_s), dl = alpha (<dout_s, v>_h - S_s), and the source
    gradient before the coupling gets alpha dout_s + r dl w_s (value and key path: w_s = q_s g_s in fp32, one
    FMA per element); c = sum over pairs and heads of dl logit. In-group sites s in [src, g_end) are computed
    here (dl stored for dq/dg). The suffix pairs s >= g_end come from the suffix pass: with SUFFIX_KEYS it
    left their value and key path in part_dv and their coupling in part_c (the "dot" suffix), else only the
    value path and dl, and a loop over them here adds their key path. dsrc = dv - r^2/D c v, written once.
    Every load of a step is issued before the step's stores (see _column_bwd_kernel). (Two in-group sites per
    step, with the next two sites' loads in flight, ran slower on an H200: 96 registers against 64.)
    Two options (FullRouting's row_w_tile, row_dl_buffer) keep the site loop clear of shared memory: W_TILE
    loads w_s as a full tile (_site_w), and G_P > 0 (a power of two >= the group's sites) keeps the in-group
    pairs' dl in registers, stored once after the loop (G_P = 0: per site, each store a layout conversion
    with two barriers)."""
    # th: offsets into the [N, P, H] tensors (lse, S); zth: into the [pairs, H, P] ones (z, dl)
    offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th = _full_row_tile(P, D, H, K, BLOCK_T, H_P, K_P)
    zth = tl.arange(0, H_P)[None, :] * P + offs_t[:, None].to(tl.int64)
    row_stride = (tl.full([], 0, tl.int64) + P) * D  # int64: rows * P * D may pass 2^31
    pair0 = _pair_row(src, src, N)

    dout_raw = tl.load(dout_new_ptr + tile, mask=mask, other=0.0)
    out_new = tl.load(out_new_ptr + tile, mask=mask, other=0.0)
    v_raw = tl.load(rows_ptr + src * row_stride + tile, mask=mask, other=0.0)  # kept in storage dtype: registers
    r = tl.load(r_ptr + src * P + offs_t, mask=mask_t, other=0.0).to(ACC)
    logit = tl.load(z_ptr + pair0 * H * P + zth, mask=mask_th, other=0.0)
    lse = tl.load(lse_ptr + src * P * H + th, mask=mask_th, other=0.0)
    col = tl.broadcast_to(col_HK[None, :, :], (BLOCK_T, H_P, K_P))  # w's offsets as a full tile
    w = _site_w(w_ptr, w_lo_ptr, src * D, col, mask, col_HK, mask_hk, ACC, W_TILE, SPLIT_W)
    if HAS_SUFFIX:
        part_dv = tl.load(part_dv_ptr + part_slot * row_stride + tile, mask=mask, other=0.0).to(ACC)
        if SUFFIX_KEYS:
            part_c = tl.load(part_c_ptr + part_slot * P * H + th, mask=mask_th, other=0.0)
    store_ty = rows_ptr.dtype.element_ty
    dout_j, S_j, logit_j, lse_j, w_j = _row_site_loads(dout_ptrs_ptr, S_ptr, z_ptr, lse_ptr, w_ptr, w_lo_ptr, src + 1,
                                                      g_end, pair0, src, tile, mask, th, zth, mask_th, col, col_HK,
                                                      mask_hk, P, D, H, store_ty, ACC, W_TILE, SPLIT_W)

    S = tl.sum(dout_raw.to(ACC) * out_new.to(ACC), axis=2)
    dv = tl.zeros([BLOCK_T, H_P, K_P], ACC)
    dl, dv, c = _row_pair(dout_raw, S, logit, lse, w, v_raw, r, mask_th, dv, tl.zeros([BLOCK_T, H_P], ACC), ACC)
    if tl.program_id(0) == 0:  # dout_new enters the table of douts for the sources before src
        tl.store(dout_ptrs_ptr + src, dout_addr)
    tl.store(S_ptr + src * P * H + th, S, mask=mask_th)
    slots, dls = _dl_buffer(BLOCK_T, H_P, G_P, ACC)  # slot i: the pair (src + i, src); stored after the loop
    dls = _keep_dl(dls, slots, 0, dl, dl_ptr + pair0 * H * P + zth, mask_th, G_P)
    # in-group sites (their dout in the table, their S in the buffer), each step's loads issued one step ahead
    for s in range(src + 1, g_end):
        dl_s, dv, c = _row_pair(dout_j, S_j, logit_j, lse_j, w_j, v_raw, r, mask_th, dv, c, ACC)
        z_off = (pair0 + s - src) * H * P + zth
        dout_j, S_j, logit_j, lse_j, w_j = _row_site_loads(dout_ptrs_ptr, S_ptr, z_ptr, lse_ptr, w_ptr, w_lo_ptr,
                                                          s + 1, g_end, pair0, src, tile, mask, th, zth, mask_th,
                                                          col, col_HK, mask_hk, P, D, H, store_ty, ACC, W_TILE,
                                                          SPLIT_W)
        dls = _keep_dl(dls, slots, s - src, dl_s, dl_ptr + z_off, mask_th, G_P)
    if G_P > 0:
        tl.store(dl_ptr + (pair0 + slots) * H * P + zth[:, :, None], dls,
                 mask=mask_th[:, :, None] & (slots < g_end - src))
    if HAS_SUFFIX:
        dv += part_dv
    if HAS_SUFFIX and SUFFIX_KEYS:
        c += part_c
    if HAS_SUFFIX and not SUFFIX_KEYS:
        # the suffix pairs' key path (their value path is part_dv); no stores, so loads run one site ahead
        dl_s, logit_s, w_s = _row_suffix_loads(dl_ptr, z_ptr, w_ptr, w_lo_ptr, g_end, pair0, src, N, zth, mask_th,
                                               col, mask, col_HK, mask_hk, P, D, H, ACC, W_TILE, SPLIT_W)
        for s in range(g_end, N):
            dl_n, logit_n, w_n = _row_suffix_loads(dl_ptr, z_ptr, w_ptr, w_lo_ptr, s + 1, pair0, src, N, zth,
                                                   mask_th, col, mask, col_HK, mask_hk, P, D, H, ACC, W_TILE,
                                                   SPLIT_W)
            dv += (dl_s * r[:, None])[:, :, None] * w_s
            c += dl_s * logit_s
            dl_s, logit_s, w_s = dl_n, logit_n, w_n
    cr = r * r * tl.sum(c, axis=1) / D  # the coupling summed over heads
    dsrc = dv - cr[:, None, None] * v_raw.to(ACC)
    tl.store(dsrc_ptr + tile, _to_storage(dsrc, dsrc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bf16_split(x, store_ty: tl.constexpr, ACC: tl.constexpr):
    """fp32 x as tensor-core operands: (hi, lo) bf16 terms for bf16 storage (x - hi - lo ~ 2^-17 |x|), else
    (x in ACC, unused)."""
    if store_ty == tl.bfloat16:
        hi = _to_storage(x, tl.bfloat16)
        lo = _to_storage(x - hi.to(tl.float32), tl.bfloat16)
        hi, lo = _mma_operand(hi, store_ty, ACC), _mma_operand(lo, store_ty, ACC)
    else:
        hi = x.to(ACC)
        lo = hi
    return hi, lo


@triton.jit
def _mma_split(a_hi, a_lo, b_hi, b_lo, acc, store_ty: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """acc + a @ b for two fp32 operands split by _bf16_split: with bf16 storage three bf16 products
    hi.hi + hi.lo + lo.hi (relative error ~2^-16 against the result's bf16 rounding of 2^-9; the operands are
    split once per kernel, where tf32x3 splits them again in every product), else one PREC product."""
    if store_ty == tl.bfloat16:
        out = _mma(a_hi, b_hi, acc, store_ty, ACC, PREC)
        out = _mma(a_hi, b_lo, out, store_ty, ACC, PREC)
        out = _mma(a_lo, b_hi, out, store_ty, ACC, PREC)
    else:
        out = _mma(a_hi, b_hi, acc, store_ty, ACC, PREC)
    return out


@triton.jit
def _keypath_slice_loads(rows_ptr, w_hi_ptr, w_lo_ptr, dvp_ptr, src, offs_t, mask_t, offs_s, mask_s, row_off, h, K,
                         D, k0, K_B: tl.constexpr):
    """Head columns [k0, k0 + K_B) of the key path's operands (all masked past K): w = q g of the sites >= src
    as its two tensor-core terms [S_P, K_B] (FullRouting.w_terms), the source row v and the value-path
    gradient dvp [BLOCK_T, K_B]."""
    offs_b = k0 + tl.arange(0, K_B)
    mask_b = offs_b < K
    col = h * K + offs_b
    w_off = (src + offs_s)[:, None] * D + col[None, :]
    mask_w = mask_s[:, None] & mask_b[None, :]
    w_hi = tl.load(w_hi_ptr + w_off, mask=mask_w, other=0.0)
    if w_hi_ptr.dtype.element_ty == tl.bfloat16:  # the second term exists only for bf16 storage
        w_lo = tl.load(w_lo_ptr + w_off, mask=mask_w, other=0.0)
    else:
        w_lo = w_hi
    tile = offs_t[:, None].to(tl.int64) * D + col[None, :]
    mask = mask_t[:, None] & mask_b[None, :]
    v = tl.load(rows_ptr + row_off + tile, mask=mask, other=0.0)
    dvp = tl.load(dvp_ptr + tile, mask=mask, other=0.0)
    return w_hi, w_lo, v, dvp


@triton.jit(do_not_specialize=["src"])
def _keypath_kernel(rows_ptr, r_ptr, w_hi_ptr, w_lo_ptr, dl_ptr, dvp_ptr, c_ptr, dsrc_ptr, src, N, P, D, H, K,
                    BLOCK_T: tl.constexpr, K_B: tl.constexpr, S_P: tl.constexpr, H_P: tl.constexpr,
                    ACC: tl.constexpr, PREC: tl.constexpr):
    """Source `src`'s gradient, one head: the key path of all its pairs through the RMSNorm,
    dsrc = dvp + r * (dl @ w) - r^2/D * c * v, with dl [BLOCK_T, sites >= src] @ w [sites, K] a
    tensor-core product (_mma_split), in K_B-wide column slices. The next slice's loads are issued before
    this slice's store: a store may alias a later load for the compiler and would make it wait."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_s = tl.arange(0, S_P)
    offs_b = tl.arange(0, K_B)
    mask_t = offs_t < P
    mask_s = src + offs_s < N
    pair = _pair_row(src, src + offs_s, N)
    row_off = (tl.full([], 0, tl.int64) + src) * P * D
    dl = tl.load(dl_ptr + (pair[None, :] * H + h) * P + offs_t[:, None],
                 mask=mask_t[:, None] & mask_s[None, :], other=0.0)  # [BLOCK_T, S_P]
    r = tl.load(r_ptr + src * P + offs_t, mask=mask_t, other=0.0).to(ACC)
    offs_h = tl.arange(0, H_P)
    c = tl.load(c_ptr + offs_h[None, :] * P + offs_t[:, None], mask=mask_t[:, None] & (offs_h[None, :] < H),
                other=0.0)
    w_hi, w_lo, v, dvp = _keypath_slice_loads(rows_ptr, w_hi_ptr, w_lo_ptr, dvp_ptr, src, offs_t, mask_t, offs_s,
                                              mask_s, row_off, h, K, D, 0, K_B)
    cr = r * r * tl.sum(c, axis=1) / D  # the coupling summed over heads
    store_ty = rows_ptr.dtype.element_ty
    dl_hi, dl_lo = _bf16_split(dl, store_ty, ACC)
    for k0 in range(0, K, K_B):
        dkr = _mma_split(dl_hi, dl_lo, _mma_operand(w_hi, store_ty, ACC), _mma_operand(w_lo, store_ty, ACC),
                         tl.zeros([BLOCK_T, K_B], ACC), store_ty, ACC, PREC)
        out = dvp + r[:, None] * dkr - cr[:, None] * v.to(ACC)
        col = h * K + k0 + offs_b
        tile = offs_t[:, None].to(tl.int64) * D + col[None, :]
        mask = mask_t[:, None] & (k0 + offs_b < K)[None, :]
        w_hi, w_lo, v, dvp = _keypath_slice_loads(rows_ptr, w_hi_ptr, w_lo_ptr, dvp_ptr, src, offs_t, mask_t,
                                                  offs_s, mask_s, row_off, h, K, D, k0 + K_B, K_B)
        tl.store(dsrc_ptr + tile, _to_storage(out, dsrc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _query_grad_kernel(rows_ptr, r_ptr, dl_ptr, a_ptr, N, P, D, H, K,
                       BLOCK_T: tl.constexpr, K_B: tl.constexpr, S_P: tl.constexpr, ACC: tl.constexpr,
                       PREC: tl.constexpr):
    """A_s = sum over sources j <= s and tokens of dl(s, j) kr_j, per head, once at the end of the
    backward (dq = A g, dg = A q on the host). One program: a token block, a head and a K_B-wide column
    slice; over the sources j it accumulates dl_j^T [sites, BLOCK_T] @ kr_j [BLOCK_T, K_B] on tensor cores
    and writes its partial a[pid_t, sites, columns] (summed over token blocks on the host, fixed order)."""
    h = tl.program_id(1)
    offs_t, mask_t, offs_s, col, mask_b, tile, mask = _query_grad_tile(P, D, K, BLOCK_T, K_B, S_P)
    a = tl.zeros([S_P, K_B], ACC)
    for j in range(0, N):
        mask_s = (offs_s >= j) & (offs_s < N)
        pair = _pair_row(j, tl.maximum(offs_s, j), N)
        dl = tl.load(dl_ptr + (pair[:, None] * H + h) * P + offs_t[None, :],
                     mask=mask_s[:, None] & mask_t[None, :], other=0.0)  # [S_P, BLOCK_T]
        a = _query_grad_row(rows_ptr, r_ptr, j, dl, a, offs_t, mask_t, tile, mask, P, D, ACC, PREC)
    _query_grad_store(a_ptr, a, N, offs_s, col, mask_b, D)


@triton.jit
def _query_grad_tile(P, D, K, BLOCK_T: tl.constexpr, K_B: tl.constexpr, S_P: tl.constexpr):
    """A dq/dg program's token block (axis 0) and K_B-wide column slice (axis 2) of head program_id(1):
    offsets and masks of its [BLOCK_T, K_B] row tile and its sites offs_s."""
    k0 = tl.program_id(2) * K_B
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_b = tl.arange(0, K_B)
    mask_t = offs_t < P
    mask_b = k0 + offs_b < K
    col = tl.program_id(1) * K + k0 + offs_b
    tile = offs_t[:, None].to(tl.int64) * D + col[None, :]
    return offs_t, mask_t, tl.arange(0, S_P), col, mask_b, tile, mask_t[:, None] & mask_b[None, :]


@triton.jit
def _query_grad_row(rows_ptr, r_ptr, row, dl, a, offs_t, mask_t, tile, mask, P, D, ACC: tl.constexpr,
                    PREC: tl.constexpr):
    """a + dl [sites, BLOCK_T] @ kr [BLOCK_T, K_B] of buffer row `row` on tensor cores."""
    store_ty = rows_ptr.dtype.element_ty
    kr = _query_grad_kr(rows_ptr, r_ptr, row, offs_t, mask_t, tile, mask, P, D, ACC)
    return _mma_weights(dl, _mma_operand(kr, store_ty, ACC), a, store_ty, ACC, PREC)


@triton.jit
def _query_grad_kr(rows_ptr, r_ptr, row, offs_t, mask_t, tile, mask, P, D, ACC: tl.constexpr):
    """The [BLOCK_T, K_B] key tile kr of buffer row `row`, in the storage dtype (as the forward rounds it)."""
    row_stride = (tl.full([], 0, tl.int64) + P) * D
    r = tl.load(r_ptr + row * P + offs_t, mask=mask_t, other=0.0).to(ACC)
    v = tl.load(rows_ptr + row * row_stride + tile, mask=mask, other=0.0).to(ACC)
    return _to_storage(v * r[:, None], rows_ptr.dtype.element_ty)


@triton.jit
def _query_grad_store(a_ptr, a, N, offs_s, col, mask_b, D):
    """This program's partial a [sites, columns] into a[token block, sites, columns]."""
    tl.store(a_ptr + (tl.program_id(0) * N + offs_s[:, None]).to(tl.int64) * D + col[None, :], a,
             mask=(offs_s[:, None] < N) & mask_b[None, :])
