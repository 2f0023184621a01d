"""Triton kernels of block-mode routing with a shared row buffer (block_routing.py; SPEC D).

Rows. Site s (0..n-1, n = 2L+1) creates row R_s of the buffer rows[n, P, D] (storage dtype):
    R_0 = embedding;  R_s = y_{s-1} + (R_{s-1} if site s-1 does not start a block else 0)
so R_s is the running partial sum of the current block, and at a block's first site s0 it is the sum of the
whole previous block: the completed block row. Block rows sit at s0 = j * span (span = 2 * layers per block).
Site s routes over the block rows j * span < s (their statistics r were stored when they were created) and
its own row R_s; this is BlockAttnRes's [embedding, B_1, .., B_{n-1}] + [partial], in the same order.

Backward, site by site in reverse order: a site's pairs with block rows add their gradient into an fp32
accumulator G[j] (the final site, first in the backward, initialises every G[j]); its own row's gradient
is finished at once: the local pair, plus G[j] when the row is a block row (every later site has added to
it), plus the gradient of R_{s+1} when R_{s+1} contains R_s (the chain through the partial sum, kept in
fp32). That total is the gradient of y_{s-1}. Pair math as in _routing_kernels (module docstring).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mhar_lit.kernels._routing_kernels import (_full_row_tile, _online_update, _pair_bwd, _rsqrt_mean_square,
                                               _to_storage)


@triton.jit(do_not_specialize=["site", "n_blk", "span", "add_prev"])
def _block_fwd_kernel(
    new_ptr, rows_ptr, r_ptr, w_ptr, out_ptr, lse_ptr, site, n_blk, span, add_prev, P, D, H, K, eps,
    BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr, UNROLL: tl.constexpr,
):
    """Site `site`: write its row R_s (new + R_{s-1} if add_prev) with its statistic, then the online softmax
    over the n_blk block rows j * span and R_s; writes out [P, D] and lse[site] [P, H]."""
    offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th = _full_row_tile(P, D, H, K, BLOCK_T, H_P, K_P)
    row_stride = (tl.full([], 0, tl.int64) + P) * D  # int64: rows * P * D may pass 2^31
    store_ty = rows_ptr.dtype.element_ty

    own = tl.load(new_ptr + tile, mask=mask, other=0.0).to(ACC)
    prev_row = tl.maximum(site - 1, 0)
    own += tl.load(rows_ptr + prev_row * row_stride + tile, mask=mask & (add_prev != 0), other=0.0).to(ACC)
    own = _to_storage(own, store_ty)
    tl.store(rows_ptr + site * row_stride + tile, own, mask=mask)
    own = own.to(ACC)
    r_own = _rsqrt_mean_square(own, D, eps)
    tl.store(r_ptr + site * P + offs_t, r_own, mask=mask_t)

    w_HK = tl.load(w_ptr + site * D + col_HK, mask=mask_hk, other=0.0).to(ACC)
    m = tl.full([BLOCK_T, H_P], float("-inf"), ACC)
    l = tl.zeros([BLOCK_T, H_P], ACC)
    acc = tl.zeros([BLOCK_T, H_P, K_P], ACC)
    for j in range(0, n_blk, UNROLL):  # UNROLL = 2: two rows' loads issued together
        row = j * span
        v = tl.load(rows_ptr + row * row_stride + tile, mask=mask, other=0.0).to(ACC)
        r = tl.load(r_ptr + row * P + offs_t, mask=mask_t, other=0.0)
        if UNROLL == 2:
            second = j + 1 < n_blk
            v2 = tl.load(rows_ptr + (row + span) * row_stride + tile, mask=mask & second, other=0.0).to(ACC)
            r2 = tl.load(r_ptr + (row + span) * P + offs_t, mask=mask_t & second, other=0.0)
            m, l, acc = _online_update(v, r, w_HK, m, l, acc, store_ty)
            m, l, acc = _online_update_if(v2, r2, second, w_HK, m, l, acc, store_ty)
        else:
            m, l, acc = _online_update(v, r, w_HK, m, l, acc, store_ty)
    m, l, acc = _online_update(own, r_own, w_HK, m, l, acc, store_ty)

    out = acc / l[:, :, None]
    tl.store(out_ptr + tile, _to_storage(out, out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + site * P * H + th, m + tl.log(l), mask=mask_th)


@triton.jit
def _online_update_if(v, r, valid, w_HK, m, l, acc, store_ty: tl.constexpr):
    """_online_update that changes nothing when `valid` is false (the row past the end of an unrolled step;
    the first row of every step is valid, so m is finite here)."""
    kr = _to_storage(v * r[:, None, None], store_ty).to(v.dtype)
    logit = tl.where(valid, tl.sum(kr * w_HK[None, :, :], axis=2), float("-inf"))
    m_new = tl.maximum(m, logit)
    scale = tl.exp(m - m_new)
    p = tl.exp(logit - m_new)
    return m_new, l * scale + p, acc * scale[:, :, None] + p[:, :, None] * v


@triton.jit
def _pair_grad_full(v, r, dout, w_HK, lse, S, D, store_ty: tl.constexpr, ACC: tl.constexpr):
    """Finished gradient of one source row for one site (RMSNorm coupling included) and its A tile."""
    kr = _to_storage(v * r[:, None, None], store_ty).to(ACC)
    dv, c, a_HK = _pair_bwd(v, kr, r, dout, w_HK, lse, S)
    dv -= (r * r * c / D)[:, None, None] * v
    return dv, a_HK


@triton.jit(do_not_specialize=["site", "n_blk", "span", "own_block", "has_chain", "write_chain", "a_slot"])
def _block_bwd_kernel(
    rows_ptr, r_ptr, w_ptr, lse_ptr, dout_ptr, out_ptr, g_ptr, chain_ptr, dsrc_ptr, a_ptr,
    site, n_blk, span, own_block, has_chain, write_chain, a_slot, P, D, H, K,
    FIRST: tl.constexpr, BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """Backward of site `site` (see module docstring): G[j] (+)= the block rows' pair gradients; dsrc = the
    finished gradient of R_s (own pair + G[own_block] if own_block >= 0 + chain if has_chain), also kept in
    chain (fp32) if write_chain; this program's partial of A into a[a_slot, pid] (summed on the host)."""
    offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th = _full_row_tile(P, D, H, K, BLOCK_T, H_P, K_P)
    row_stride = (tl.full([], 0, tl.int64) + P) * D
    store_ty = rows_ptr.dtype.element_ty

    dout = tl.load(dout_ptr + tile, mask=mask, other=0.0).to(ACC)
    S = tl.sum(dout * tl.load(out_ptr + tile, mask=mask, other=0.0).to(ACC), axis=2)
    w_HK = tl.load(w_ptr + site * D + col_HK, mask=mask_hk, other=0.0).to(ACC)
    lse = tl.load(lse_ptr + site * P * H + th, mask=mask_th, other=0.0)
    a = tl.zeros([H_P, K_P], ACC)
    for j in range(0, n_blk, UNROLL):  # UNROLL = 2: two rows' loads issued together
        row = j * span
        v = tl.load(rows_ptr + row * row_stride + tile, mask=mask, other=0.0).to(ACC)
        r = tl.load(r_ptr + row * P + offs_t, mask=mask_t, other=0.0)
        if UNROLL == 2:
            # a row past the end loads as zeros: its kr is 0, so its A tile is 0; its dv is never stored
            mask2 = mask & (j + 1 < n_blk)
            v2 = tl.load(rows_ptr + (row + span) * row_stride + tile, mask=mask2, other=0.0).to(ACC)
            r2 = tl.load(r_ptr + (row + span) * P + offs_t, mask=mask_t & (j + 1 < n_blk), other=0.0)
            if not FIRST:
                g = tl.load(g_ptr + j * row_stride + tile, mask=mask, other=0.0)
                g2 = tl.load(g_ptr + (j + 1) * row_stride + tile, mask=mask2, other=0.0)
            dv, a_HK = _pair_grad_full(v, r, dout, w_HK, lse, S, D, store_ty, ACC)
            dv2, a2_HK = _pair_grad_full(v2, r2, dout, w_HK, lse, S, D, store_ty, ACC)
            a += a_HK + a2_HK
            if not FIRST:
                dv += g
                dv2 += g2
            tl.store(g_ptr + j * row_stride + tile, dv, mask=mask)
            tl.store(g_ptr + (j + 1) * row_stride + tile, dv2, mask=mask2)
        else:
            dv, a_HK = _pair_grad_full(v, r, dout, w_HK, lse, S, D, store_ty, ACC)
            a += a_HK
            if not FIRST:
                dv += tl.load(g_ptr + j * row_stride + tile, mask=mask, other=0.0)
            tl.store(g_ptr + j * row_stride + tile, dv, mask=mask)

    v = tl.load(rows_ptr + site * row_stride + tile, mask=mask, other=0.0).to(ACC)
    r = tl.load(r_ptr + site * P + offs_t, mask=mask_t, other=0.0)
    dv, a_HK = _pair_grad_full(v, r, dout, w_HK, lse, S, D, store_ty, ACC)
    a += a_HK
    own_g = tl.maximum(own_block, 0)
    dv += tl.load(g_ptr + own_g * row_stride + tile, mask=mask & (own_block >= 0), other=0.0)
    dv += tl.load(chain_ptr + tile, mask=mask & (has_chain != 0), other=0.0)
    tl.store(chain_ptr + tile, dv, mask=mask & (write_chain != 0))
    tl.store(dsrc_ptr + tile, _to_storage(dv, dsrc_ptr.dtype.element_ty), mask=mask)
    tl.store(a_ptr + (a_slot * tl.num_programs(0) + tl.program_id(0)) * D + col_HK, a, mask=mask_hk)


# ---- backward with one pass per block (BlockRouting(backward="block_pass")). The site kernel keeps, for each
# site of the current block, its dout and every block pair's alpha and dl (per-block buffers: span + 1 rows of
# dout, a pair table [span + 1, blocks, 2, P, H] fp32) and sums each pair's coupling into C[j] [P]. When the
# backward reaches the block's first site, one pass reads, per block row j <= k, the row's inputs and the
# block's douts once and adds the block's value and key path into G[j] with one fp32 read + write per block
# instead of per site; row k itself (the block's own row) is finished there. The buffers are then reused by the
# block before. Per (site, block row) pair that is one dout read plus 1/span of an fp32 read + write.

@triton.jit
def _pair_table_offsets(slot, j, NB, P, H, th):
    base = ((tl.full([], 0, tl.int64) + slot) * NB + j) * 2 * P * H
    return base + th, base + P * H + th


@triton.jit
def _pair_softmax_grad(v, r, dout, w_HK, lse, S, store_ty: tl.constexpr, ACC: tl.constexpr):
    """alpha, dl, the coupling c = sum_h dl * logit [BLOCK_T] and the A tile of one (site, row) pair."""
    kr = _to_storage(v * r[:, None, None], store_ty).to(ACC)
    logit = tl.sum(kr * w_HK[None, :, :], axis=2)
    alpha = tl.exp(logit - lse)
    dl = alpha * (tl.sum(dout * v, axis=2) - S)
    return alpha, dl, tl.sum(dl * logit, axis=1), tl.sum(dl[:, :, None] * kr, axis=0)


@triton.jit
def _keep_pair(pair_ptr, c_ptr, alpha, dl, c, slot, j, NB, P, H, th, mask_th, offs_t, mask_t, INIT: tl.constexpr):
    alpha_off, dl_off = _pair_table_offsets(slot, j, NB, P, H, th)
    tl.store(pair_ptr + alpha_off, alpha, mask=mask_th)
    tl.store(pair_ptr + dl_off, dl, mask=mask_th)
    if not INIT:
        c += tl.load(c_ptr + j * P + offs_t, mask=mask_t, other=0.0)
    tl.store(c_ptr + j * P + offs_t, c, mask=mask_t)


@triton.jit(do_not_specialize=["site", "slot", "n_blk", "span", "own_block", "has_chain", "write_chain", "a_slot"])
def _block_site_bwd_kernel(
    rows_ptr, r_ptr, w_ptr, lse_ptr, dout_ptr, out_ptr, dout_buf_ptr, pair_ptr, c_ptr, chain_ptr, dsrc_ptr, a_ptr,
    site, slot, n_blk, span, own_block, has_chain, write_chain, a_slot, NB, P, D, H, K,
    FIRST: tl.constexpr, BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr,
):
    """Site `site` (slot `slot` of its block): dout into dout_buf[slot]; alpha, dl of every block pair (and of
    its own row if that is block row own_block) into the pair table, couplings into C; this program's A
    partial. An own row that is not a block row (the partial sum) is finished here, as in _block_bwd_kernel."""
    offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th = _full_row_tile(P, D, H, K, BLOCK_T, H_P, K_P)
    row_stride = (tl.full([], 0, tl.int64) + P) * D
    store_ty = rows_ptr.dtype.element_ty

    dout_raw = tl.load(dout_ptr + tile, mask=mask, other=0.0)
    tl.store(dout_buf_ptr + slot * row_stride + tile, dout_raw.to(dout_buf_ptr.dtype.element_ty), mask=mask)
    dout = dout_raw.to(ACC)
    S = tl.sum(dout * tl.load(out_ptr + tile, mask=mask, other=0.0).to(ACC), axis=2)
    w_HK = tl.load(w_ptr + site * D + col_HK, mask=mask_hk, other=0.0).to(ACC)
    lse = tl.load(lse_ptr + site * P * H + th, mask=mask_th, other=0.0)
    a = tl.zeros([H_P, K_P], ACC)
    for j in range(0, n_blk):
        row = j * span
        v = tl.load(rows_ptr + row * row_stride + tile, mask=mask, other=0.0).to(ACC)
        r = tl.load(r_ptr + row * P + offs_t, mask=mask_t, other=0.0)
        alpha, dl, c, a_HK = _pair_softmax_grad(v, r, dout, w_HK, lse, S, store_ty, ACC)
        a += a_HK
        _keep_pair(pair_ptr, c_ptr, alpha, dl, c, slot, j, NB, P, H, th, mask_th, offs_t, mask_t, FIRST)

    v = tl.load(rows_ptr + site * row_stride + tile, mask=mask, other=0.0).to(ACC)
    r = tl.load(r_ptr + site * P + offs_t, mask=mask_t, other=0.0)
    alpha, dl, c, a_HK = _pair_softmax_grad(v, r, dout, w_HK, lse, S, store_ty, ACC)
    a += a_HK
    if own_block >= 0:  # a block row: the block pass (_block_pass_bwd_kernel) finishes it
        _keep_pair(pair_ptr, c_ptr, alpha, dl, c, slot, own_block, NB, P, H, th, mask_th, offs_t, mask_t, False)
    else:
        dv = alpha[:, :, None] * dout + (dl * r[:, None])[:, :, None] * w_HK[None, :, :]
        dv -= (r * r * c / D)[:, None, None] * v
        dv += tl.load(chain_ptr + tile, mask=mask & (has_chain != 0), other=0.0)
        tl.store(chain_ptr + tile, dv, mask=mask & (write_chain != 0))
        tl.store(dsrc_ptr + tile, _to_storage(dv, dsrc_ptr.dtype.element_ty), mask=mask)
    tl.store(a_ptr + (a_slot * tl.num_programs(0) + tl.program_id(0)) * D + col_HK, a, mask=mask_hk)


@triton.jit
def _block_paths(dout_buf_ptr, pair_ptr, w_ptr, j, s_lo, n_slots, NB, P, D, H, tile, mask, th, mask_th, col_HK,
                 mask_hk, row_stride, BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr,
                 ACC: tl.constexpr):
    """sum over the block's sites of alpha * dout (value path) and dl * w (key path, before r) for row j."""
    value = tl.zeros([BLOCK_T, H_P, K_P], ACC)
    key = tl.zeros([BLOCK_T, H_P, K_P], ACC)
    for slot in range(0, n_slots):
        alpha_off, dl_off = _pair_table_offsets(slot, j, NB, P, H, th)
        dout = tl.load(dout_buf_ptr + slot * row_stride + tile, mask=mask, other=0.0).to(ACC)
        alpha = tl.load(pair_ptr + alpha_off, mask=mask_th, other=0.0)
        dl = tl.load(pair_ptr + dl_off, mask=mask_th, other=0.0)
        w_HK = tl.load(w_ptr + (s_lo + slot) * D + col_HK, mask=mask_hk, other=0.0).to(ACC)
        value += alpha[:, :, None] * dout
        key += dl[:, :, None] * w_HK[None, :, :]
    return value, key


@triton.jit(do_not_specialize=["block", "s_lo", "n_slots", "span", "write_chain"])
def _block_pass_bwd_kernel(
    rows_ptr, r_ptr, w_ptr, dout_buf_ptr, pair_ptr, c_ptr, g_ptr, chain_ptr, dsrc_ptr,
    block, s_lo, n_slots, span, write_chain, NB, P, D, H, K,
    LAST: tl.constexpr, BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr,
):
    """Block `block` (sites s_lo .. s_lo + n_slots - 1) is done: add its paths into G[j] for the block rows
    j < block (LAST: the last block initialises G), then finish block row `block` (buffer row s_lo): its G plus
    this block's paths, minus the coupling r^2 / D * C * v, into dsrc (and chain)."""
    offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th = _full_row_tile(P, D, H, K, BLOCK_T, H_P, K_P)
    row_stride = (tl.full([], 0, tl.int64) + P) * D
    for j in range(0, block):
        r = tl.load(r_ptr + j * span * P + offs_t, mask=mask_t, other=0.0)
        value, key = _block_paths(dout_buf_ptr, pair_ptr, w_ptr, j, s_lo, n_slots, NB, P, D, H, tile, mask, th,
                                  mask_th, col_HK, mask_hk, row_stride, BLOCK_T, H_P, K_P, ACC)
        g = value + r[:, None, None] * key
        if not LAST:
            g += tl.load(g_ptr + j * row_stride + tile, mask=mask, other=0.0)
        tl.store(g_ptr + j * row_stride + tile, g, mask=mask)
    v = tl.load(rows_ptr + s_lo * row_stride + tile, mask=mask, other=0.0).to(ACC)
    r = tl.load(r_ptr + s_lo * P + offs_t, mask=mask_t, other=0.0)
    value, key = _block_paths(dout_buf_ptr, pair_ptr, w_ptr, block, s_lo, n_slots, NB, P, D, H, tile, mask, th,
                              mask_th, col_HK, mask_hk, row_stride, BLOCK_T, H_P, K_P, ACC)
    dv = value + r[:, None, None] * key
    if not LAST:
        dv += tl.load(g_ptr + block * row_stride + tile, mask=mask, other=0.0)
    c = tl.load(c_ptr + block * P + offs_t, mask=mask_t, other=0.0)
    dv -= (r * r * c / D)[:, None, None] * v
    tl.store(chain_ptr + tile, dv, mask=mask & (write_chain != 0))
    tl.store(dsrc_ptr + tile, _to_storage(dv, dsrc_ptr.dtype.element_ty), mask=mask)
