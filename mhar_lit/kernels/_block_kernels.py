"""Triton kernels of block-mode routing with a shared row buffer (block_routing.py; SPEC D).

Rows. Site s (0..n-1, n = 2L+1) creates row R_s of the buffer rows[n, P, D] (storage dtype):
    R_0 = embedding;  R_s = y_{s-1} + (R_{s-1} if site s-1 does not start a block else 0)
so R_s is the running partial sum of the current block, and at a block's first site s0 it is the sum of the
whole previous block: the completed block row. Block rows sit at s0 = j * span (span = 2 * layers per block).
Site s routes over the block rows j * span < s (their statistics r were stored when they were created) and
its own row R_s; this is BlockAttnRes's [embedding, B_1, .., B_{n-1}] + [partial], in the same order.

Backward, site by site in reverse order (one site kernel each, plus one block pass at a block's first site):
a site's pairs with block rows keep their softmax weights and gradients in a per-block pair table, and the
block pass adds the whole block into the fp32 block-row gradients G[j] (see the section below). A row that
is not a block row (a partial sum) is read by its own site only and is finished there: the local pair, plus
the gradient of R_{s+1} when R_{s+1} contains R_s. That gradient is the dsrc the next site returned (the
gradient of y_s = the gradient of R_{s+1}), read back in the storage dtype: the chain through the partial sum
is rounded at every step as in the PyTorch reference's own autograd (exact with fp32 storage), and no fp32
chain buffer is read and written per site. The finished total is the gradient of y_{s-1}. Pair math as in
_routing_kernels (module docstring).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mhar_lit.kernels._routing_kernels import (_dout_rows, _full_row_tile, _full_row_tile_at, _online_update,
                                               _rsqrt_mean_square, _to_storage)


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


# ---- backward with one pass per block. The site kernel keeps, for each site of the current block, every block
# pair's alpha and dl (a per-block pair table [span + 1, blocks, 2, P, H] fp32) and sums each pair's coupling
# into C[j] [P]; the site's dout is not copied: the tensor autograd delivered is kept by BlockRouting and the
# kernel enters its address into a per-block table (_dout_rows, as FullRouting's douts). When the backward
# reaches the block's first site, one pass reads, per block row j <= k, the row's inputs and the block's douts
# once and adds the block's value and key path into G[j] with one fp32 read + write per block instead of per
# site; row k itself (the block's own row) is finished there. The tables are then reused by the block before.
# Per (site, block row) pair that is one dout read plus 1/span of an fp32 read + write.

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


@triton.jit(do_not_specialize=["site", "slot", "n_blk", "span", "own_block", "has_chain", "a_slot"])
def _block_site_bwd_kernel(
    rows_ptr, r_ptr, w_ptr, lse_ptr, dout_ptr, out_ptr, dout_ptrs_ptr, pair_ptr, c_ptr, chain_ptr, dsrc_ptr, a_ptr,
    site, slot, n_blk, span, own_block, has_chain, a_slot, NB, P, D, H, K, dout_addr,
    FIRST: tl.constexpr, BLOCK_T: tl.constexpr, TILES: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr,
    ACC: tl.constexpr,
):
    """Site `site` (slot `slot` of its block): its dout's address (dout_addr) into dout_ptrs[slot]; alpha, dl
    of every block pair (and of its own row if that is block row own_block) into the pair table, couplings
    into C; this program's partial of A into a[a_slot, pid] (summed on the host). A program does TILES token
    tiles in turn, so that the A partials (D fp32 per program) are TILES times fewer. An own row that is not a
    block row (the partial sum) is finished here: dsrc = its pair's gradient + chain (the next site's dsrc,
    storage dtype) if has_chain."""
    a = tl.zeros([H_P, K_P], ACC)
    if TILES == 1:  # no loop: the loop costs registers (sm_90: 143 -> 168 at 100M, 80 -> 93 at 1B)
        a = _block_site_tile(rows_ptr, r_ptr, w_ptr, lse_ptr, dout_ptr, out_ptr, pair_ptr, c_ptr, chain_ptr,
                             dsrc_ptr, a, tl.program_id(0), site, slot, n_blk, span, own_block, has_chain, NB, P, D,
                             H, K, FIRST, BLOCK_T, H_P, K_P, ACC)
    else:
        for i in range(0, TILES):
            a = _block_site_tile(rows_ptr, r_ptr, w_ptr, lse_ptr, dout_ptr, out_ptr, pair_ptr, c_ptr, chain_ptr,
                                 dsrc_ptr, a, tl.program_id(0) * TILES + i, site, slot, n_blk, span, own_block,
                                 has_chain, NB, P, D, H, K, FIRST, BLOCK_T, H_P, K_P, ACC)
    _, _, col_HK, mask_hk, _, _, _, _ = _full_row_tile(P, D, H, K, BLOCK_T, H_P, K_P)
    tl.store(a_ptr + (a_slot * tl.num_programs(0) + tl.program_id(0)) * D + col_HK, a, mask=mask_hk)
    if tl.program_id(0) == 0:  # the block pass finds this dout through the table (stored last: see LOG, load order)
        tl.store(dout_ptrs_ptr + slot, dout_addr)


@triton.jit
def _block_site_tile(rows_ptr, r_ptr, w_ptr, lse_ptr, dout_ptr, out_ptr, pair_ptr, c_ptr, chain_ptr, dsrc_ptr, a,
                     index, site, slot, n_blk, span, own_block, has_chain, NB, P, D, H, K, FIRST: tl.constexpr,
                     BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr):
    """_block_site_bwd_kernel's work on token tile `index`; returns a plus its A tile. (w is loaded per tile,
    from cache after the first: held across the tile loop it cost registers.)"""
    offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th = _full_row_tile_at(index, P, D, H, K, BLOCK_T, H_P, K_P)
    row_stride = (tl.full([], 0, tl.int64) + P) * D
    store_ty = rows_ptr.dtype.element_ty

    dout = tl.load(dout_ptr + tile, mask=mask, other=0.0).to(ACC)
    S = tl.sum(dout * tl.load(out_ptr + tile, mask=mask, other=0.0).to(ACC), axis=2)
    w_HK = tl.load(w_ptr + site * D + col_HK, mask=mask_hk, other=0.0).to(ACC)
    lse = tl.load(lse_ptr + site * P * H + th, mask=mask_th, other=0.0)
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
        dv += tl.load(chain_ptr + tile, mask=mask & (has_chain != 0), other=0.0).to(ACC)
        tl.store(dsrc_ptr + tile, _to_storage(dv, dsrc_ptr.dtype.element_ty), mask=mask)
    return a


@triton.jit
def _block_paths(dout_ptrs_ptr, pair_ptr, w_ptr, j, s_lo, n_slots, NB, P, D, H, tile, mask, th, mask_th, col_HK,
                 mask_hk, BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr,
                 store_ty: tl.constexpr):
    """sum over the block's sites of alpha * dout (value path) and dl * w (key path, before r) for row j."""
    value = tl.zeros([BLOCK_T, H_P, K_P], ACC)
    key = tl.zeros([BLOCK_T, H_P, K_P], ACC)
    for slot in range(0, n_slots):
        alpha_off, dl_off = _pair_table_offsets(slot, j, NB, P, H, th)
        dout = tl.load(_dout_rows(dout_ptrs_ptr, slot, slot < n_slots, store_ty) + tile, mask=mask,
                       other=0.0).to(ACC)
        alpha = tl.load(pair_ptr + alpha_off, mask=mask_th, other=0.0)
        dl = tl.load(pair_ptr + dl_off, mask=mask_th, other=0.0)
        w_HK = tl.load(w_ptr + (s_lo + slot) * D + col_HK, mask=mask_hk, other=0.0).to(ACC)
        value += alpha[:, :, None] * dout
        key += dl[:, :, None] * w_HK[None, :, :]
    return value, key


@triton.jit(do_not_specialize=["block", "s_lo", "n_slots", "span"])
def _block_pass_bwd_kernel(
    rows_ptr, r_ptr, w_ptr, dout_ptrs_ptr, pair_ptr, c_ptr, g_ptr, dsrc_ptr,
    block, s_lo, n_slots, span, NB, P, D, H, K,
    LAST: tl.constexpr, BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr,
):
    """Block `block` (sites s_lo .. s_lo + n_slots - 1, their douts in dout_ptrs[0 .. n_slots)) is done: add its
    paths into G[j] for the block rows j < block (LAST: the last block initialises G), then finish block row
    `block` (buffer row s_lo): its G plus this block's paths, minus the coupling r^2 / D * C * v, into dsrc. (Its
    row R_{s_lo + 1} does not contain it, so no chain comes in; the site before reads this dsrc as its chain.)"""
    offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th = _full_row_tile(P, D, H, K, BLOCK_T, H_P, K_P)
    row_stride = (tl.full([], 0, tl.int64) + P) * D
    store_ty = rows_ptr.dtype.element_ty
    for j in range(0, block):
        r = tl.load(r_ptr + j * span * P + offs_t, mask=mask_t, other=0.0)
        value, key = _block_paths(dout_ptrs_ptr, pair_ptr, w_ptr, j, s_lo, n_slots, NB, P, D, H, tile, mask, th,
                                  mask_th, col_HK, mask_hk, BLOCK_T, H_P, K_P, ACC, store_ty)
        g = value + r[:, None, None] * key
        if not LAST:
            g += tl.load(g_ptr + j * row_stride + tile, mask=mask, other=0.0)
        tl.store(g_ptr + j * row_stride + tile, g, mask=mask)
    v = tl.load(rows_ptr + s_lo * row_stride + tile, mask=mask, other=0.0).to(ACC)
    r = tl.load(r_ptr + s_lo * P + offs_t, mask=mask_t, other=0.0)
    value, key = _block_paths(dout_ptrs_ptr, pair_ptr, w_ptr, block, s_lo, n_slots, NB, P, D, H, tile, mask, th,
                              mask_th, col_HK, mask_hk, BLOCK_T, H_P, K_P, ACC, store_ty)
    dv = value + r[:, None, None] * key
    if not LAST:
        dv += tl.load(g_ptr + block * row_stride + tile, mask=mask, other=0.0)
    c = tl.load(c_ptr + block * P + offs_t, mask=mask_t, other=0.0)
    dv -= (r * r * c / D)[:, None, None] * v
    tl.store(dsrc_ptr + tile, _to_storage(dv, dsrc_ptr.dtype.element_ty), mask=mask)
