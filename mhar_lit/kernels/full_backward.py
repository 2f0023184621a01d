"""Triton kernels of full-mode routing, backward (full_routing.py; docs/method.md B, C, I).

`_suffix_dot_bwd_kernel`: one read of a group's rows and of every later dout (tensor-core products per
token). Then per source either `_column_row_bwd_kernel` (full rows: in-group pairs, key path and coupling in
one pass) or, per head, `_column_bwd_kernel` (in-group pairs) and `_keypath_kernel`. `_query_grad_kernel`:
dq, dg as tensor-core contractions over sites and tokens, on dl projected by `_project_dl_kernel`. Math: common.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mhar_lit.kernels.common import (_dout_rows, _full_row_tile, _mma, _mma_operand, _mma_weights, _pair_row,
                                     _project_pair, _query_grad_row, _query_grad_store, _query_grad_tile, _site_w,
                                     _to_storage)


@triton.jit
def _head_slice(offs_t, h, K, D, k0, KW: tl.constexpr):
    """Offsets [BLOCK_T, 1, KW] of head h's columns [k0, k0 + KW) in a [P, D] row, and their mask (< K)."""
    offs_k = k0 + tl.arange(0, KW)
    tok = (offs_t.to(tl.int64) * D)[:, None, None] + (h * K + offs_k)[None, None, :]
    return tok, (offs_k < K)[None, None, :]


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


@triton.jit(do_not_specialize=["n_lo", "n_src", "s_lo"])
def _suffix_dot_bwd_kernel(
    rows_ptr, lse_ptr, S_ptr, dout_ptrs_ptr, z_ptr, dl_ptr, part_dv_ptr,
    n_lo, n_src, s_lo, s_hi, N, P, D, H, K,
    r_ptr, w_hi_ptr, w_lo_ptr, part_c_ptr,
    G_P: tl.constexpr, BLOCK_T: tl.constexpr, K_A: tl.constexpr, K_B: tl.constexpr, S_B: tl.constexpr,
    ACC: tl.constexpr, PREC: tl.constexpr, KEYPATH: tl.constexpr,
):
    """The suffix pass (FullRouting._suffix): value path and dl of every later site against a group of sources,
    one read of each, on tensor cores. Per token and head it is two small matrix products: gdot [G, S] = V [G, K] @ dout^T [K, S] and dv [G, K] += alpha [G, S] @
    dout [S, K]; a program runs them batched over its BLOCK_T tokens for S_B later sites per step (G_P and
    S_B >= 16, the products' smallest size). So a step loads S_B sites' dout at once instead of one, and the
    per-element work leaves the CUDA cores. The head's K columns are two power-of-two slices K_A + K_B
    (K_B = 0: one slice) so that K = 160 is 128 + 32 wide, not padded to 256.

    KEYPATH (for the full-row column kernel): the pairs' key path joins the value path in part_dv, as a third
    product per token, dv [G, K] += (r dl) [G, S] @ w [S, K] (w = q g of the later sites, _mma_split), and
    their share of the RMSNorm coupling, sum over the later sites of dl * logit, goes to part_c [G, P, H]. The
    column kernel then adds both and reads no suffix pair.

    Its length is one program's loop over the later sites with the loads of the next step issued early; the
    pieces that stand alone are @triton.jit helpers (_mma, _mma_weights, _suffix_keypath)."""
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
    step, the next step's loads issued before this step's store of dl. That load-before-store order across the
    loop is why it is one long function rather than several jit helpers."""
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
def _row_site_loads(dout_ptrs_ptr, S_ptr, z_ptr, lse_ptr, w_ptr, s, g_end, pair0, src, tile, mask, th, zth,
                    mask_th, col_HK, mask_hk, P, D, H, store_ty: tl.constexpr, ACC: tl.constexpr):
    """What the full-row column kernel reads of in-group site s (< g_end, else zeros): dout [BLOCK_T, H_P, K_P]
    (storage dtype), S, logit and lse [BLOCK_T, H_P], and w_s = q_s g_s (_site_w)."""
    ok = s < g_end
    dout = tl.load(_dout_rows(dout_ptrs_ptr, s, ok, store_ty) + tile, mask=mask & ok, other=0.0)
    S = tl.load(S_ptr + s * P * H + th, mask=mask_th & ok, other=0.0)
    logit = tl.load(z_ptr + (pair0 + s - src) * H * P + zth, mask=mask_th & ok, other=0.0)
    lse = tl.load(lse_ptr + s * P * H + th, mask=mask_th & ok, other=0.0)
    w = _site_w(w_ptr, s * D, col_HK, mask_hk & ok, ACC)
    return dout, S, logit, lse, w


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
    rows_ptr, r_ptr, w_ptr, lse_ptr, S_ptr, dout_ptrs_ptr, dout_new_ptr, out_new_ptr,
    z_ptr, dl_ptr, part_dv_ptr, part_c_ptr, dsrc_ptr,
    src, g_end, part_slot, N, P, D, H, K, dout_addr,
    HAS_SUFFIX: tl.constexpr, BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr,
):
    """Full-mode backward of site `src` on full rows (every head of a token block in one program): the work of
    _column_bwd_kernel and _keypath_kernel in one pass, so the fp32 value-path gradient and the coupling never
    go through memory. The RMSNorm coupling sums over heads, which is why per-head programs need two kernels.

    Per pair (s, src), head h: alpha = exp(logit - lse_s), dl = alpha (<dout_s, v>_h - S_s), and the source
    gradient before the coupling gets alpha dout_s + r dl w_s (value and key path: w_s = q_s g_s in fp32, one
    FMA per element); c = sum over pairs and heads of dl logit. In-group sites s in [src, g_end) are computed
    here (dl stored for dq/dg). The suffix pairs s >= g_end come from the suffix pass, which left their value
    and key path in part_dv and their coupling in part_c. dsrc = dv - r^2/D c v, written once.
    Every load of a step is issued before the step's stores (see _column_bwd_kernel). (Two in-group sites per
    step, with the next two sites' loads in flight, ran slower on an H200: 96 registers against 64.)"""
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
    w = _site_w(w_ptr, src * D, col_HK, mask_hk, ACC)
    if HAS_SUFFIX:
        part_dv = tl.load(part_dv_ptr + part_slot * row_stride + tile, mask=mask, other=0.0).to(ACC)
        part_c = tl.load(part_c_ptr + part_slot * P * H + th, mask=mask_th, other=0.0)
    store_ty = rows_ptr.dtype.element_ty
    dout_j, S_j, logit_j, lse_j, w_j = _row_site_loads(dout_ptrs_ptr, S_ptr, z_ptr, lse_ptr, w_ptr, src + 1, g_end,
                                                      pair0, src, tile, mask, th, zth, mask_th, col_HK, mask_hk, P,
                                                      D, H, store_ty, ACC)

    S = tl.sum(dout_raw.to(ACC) * out_new.to(ACC), axis=2)
    dv = tl.zeros([BLOCK_T, H_P, K_P], ACC)
    dl, dv, c = _row_pair(dout_raw, S, logit, lse, w, v_raw, r, mask_th, dv, tl.zeros([BLOCK_T, H_P], ACC), ACC)
    if tl.program_id(0) == 0:  # dout_new enters the table of douts for the sources before src
        tl.store(dout_ptrs_ptr + src, dout_addr)
    tl.store(S_ptr + src * P * H + th, S, mask=mask_th)
    tl.store(dl_ptr + pair0 * H * P + zth, dl, mask=mask_th)
    # in-group sites (their dout in the table, their S in the buffer), each step's loads issued one step ahead
    for s in range(src + 1, g_end):
        dl_s, dv, c = _row_pair(dout_j, S_j, logit_j, lse_j, w_j, v_raw, r, mask_th, dv, c, ACC)
        z_off = (pair0 + s - src) * H * P + zth
        dout_j, S_j, logit_j, lse_j, w_j = _row_site_loads(dout_ptrs_ptr, S_ptr, z_ptr, lse_ptr, w_ptr, s + 1, g_end,
                                                          pair0, src, tile, mask, th, zth, mask_th, col_HK, mask_hk,
                                                          P, D, H, store_ty, ACC)
        tl.store(dl_ptr + z_off, dl_s, mask=mask_th)
    if HAS_SUFFIX:
        dv += part_dv
        c += part_c
    cr = r * r * tl.sum(c, axis=1) / D  # the coupling summed over heads
    dsrc = dv - cr[:, None, None] * v_raw.to(ACC)
    tl.store(dsrc_ptr + tile, _to_storage(dsrc, dsrc_ptr.dtype.element_ty), mask=mask)


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
def _project_dl_kernel(dl_ptr, z_ptr, lse_ptr, N, P, H, BLOCK_T: tl.constexpr):
    """Every pair of site program_id(2), head program_id(1), token block program_id(0): dl in place with the
    site's dl sum over its sources j <= s projected out (_projected_dl), before _query_grad_kernel. The second
    read of the site's dl rows finds them in cache (at most N rows of BLOCK_T values)."""
    s = tl.program_id(2)
    h = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < P
    sigma = tl.zeros([BLOCK_T], dl_ptr.dtype.element_ty)
    for j in range(0, s + 1):
        sigma += tl.load(dl_ptr + (_pair_row(j, s, N) * H + h) * P + offs_t, mask=mask_t, other=0.0)
    lse = tl.load(lse_ptr + (s * P + offs_t.to(tl.int64)) * H + h, mask=mask_t, other=0.0)
    for j in range(0, s + 1):
        _project_pair(dl_ptr, z_ptr, (_pair_row(j, s, N) * H + h) * P + offs_t, mask_t, lse, sigma)
