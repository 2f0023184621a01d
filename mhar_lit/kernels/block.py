"""Triton kernels of block-mode routing with a shared row buffer (block_routing.py; docs/method.md D).

Rows. Site s (0..n-1, n = 2L+1) creates row R_s of the buffer rows[n, P, D] (storage dtype):
    R_0 = embedding;  R_s = y_{s-1} + (R_{s-1} if site s-1 does not start a block else 0)
so R_s is the running partial sum of the current block, and at a block's first site s0 it is the sum of the
whole previous block: the completed block row. Block rows sit at s0 = j * span (span = 2 * layers per block).
Site s routes over the block rows j * span < s (their statistics r were stored when they were created) and
its own row R_s; this is BlockAttnRes's [embedding, B_1, .., B_{n-1}] + [partial], in the same order.

Backward, site by site in reverse order (one site kernel each, plus one block pass at a block's first site;
see the section below): the site kernel takes S = <dout, out> and finishes its own row where that is not a
block row (a partial sum, read by its own site only): the local pair, plus the gradient of R_{s+1} when R_{s+1}
contains R_s. That gradient is the dsrc the next site returned (the gradient of y_s = the gradient of R_{s+1}),
read back in the storage dtype: the chain through the partial sum is rounded at every step, as in the PyTorch
reference's own autograd (exact with fp32 storage). The finished total is the gradient of y_{s-1}. The block
pass forms every pair of a block row with the block's sites and adds them into the fp32 block-row gradients
G[j]. Pair math: common.py.
"""


from __future__ import annotations

import triton
import triton.language as tl

from mhar_lit.kernels.common import (_dout_rows, _full_row_tile, _full_row_tile_at, _online_update,
                                     _pair_grads_per_head, _project_pair, _query_grad_kr, _query_grad_row,
                                     _query_grad_store, _query_grad_tile, _rsqrt_mean_square, _site_w, _to_storage)




@triton.jit(do_not_specialize=["site", "n_blk", "span", "add_prev"])
def _block_fwd_kernel(
    new_ptr, rows_ptr, r_ptr, w_ptr, out_ptr, lse_ptr, site, n_blk, span, add_prev, P, D, H, K, eps,
    BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr, STAGES: tl.constexpr,
):
    """Site `site`: the online softmax over the n_blk block rows j * span, then its row R_s (new + R_{s-1} if
    add_prev) written with its statistic and folded in last; writes out [P, D] and lse[site] [P, H]."""
    offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th = _full_row_tile(P, D, H, K, BLOCK_T, H_P, K_P)
    row_stride = (tl.full([], 0, tl.int64) + P) * D  # int64: rows * P * D may pass 2^31
    store_ty = rows_ptr.dtype.element_ty

    w_HK = tl.load(w_ptr + site * D + col_HK, mask=mask_hk, other=0.0).to(ACC)
    m = tl.full([BLOCK_T, H_P], float("-inf"), ACC)
    l = tl.zeros([BLOCK_T, H_P], ACC)
    acc = tl.zeros([BLOCK_T, H_P, K_P], ACC)
    for j in tl.range(0, n_blk, num_stages=STAGES):
        row = j * span
        v = tl.load(rows_ptr + row * row_stride + tile, mask=mask, other=0.0).to(ACC)
        r = tl.load(r_ptr + row * P + offs_t, mask=mask_t, other=0.0)
        m, l, acc = _online_update(v, r, w_HK, m, l, acc, store_ty)
    # the own row after the block rows (the loop reads no row >= site): the loop's pipelined loads start at once
    # and the row is not held in registers through the loop
    own = tl.load(new_ptr + tile, mask=mask, other=0.0).to(ACC)
    prev_row = tl.maximum(site - 1, 0)
    own += tl.load(rows_ptr + prev_row * row_stride + tile, mask=mask & (add_prev != 0), other=0.0).to(ACC)
    own = _to_storage(own, store_ty)
    tl.store(rows_ptr + site * row_stride + tile, own, mask=mask)
    own = own.to(ACC)
    r_own = _rsqrt_mean_square(own, D, eps)
    tl.store(r_ptr + site * P + offs_t, r_own, mask=mask_t)

    m, l, acc = _online_update(own, r_own, w_HK, m, l, acc, store_ty)

    out = acc / l[:, :, None]
    tl.store(out_ptr + tile, _to_storage(out, out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + site * P * H + th, m + tl.log(l), mask=mask_th)


# Backward. Per site (reverse order) a light site kernel: S = <dout, out> per head into the block's S table,
# the site's dout address into the block's dout table (the tensor autograd delivered, kept by BlockRouting: no
# copy), and, where its own row is a partial sum, that row finished at once (the pair, plus the chain). Per
# block, at its first site, one pass over the block rows j <= k: each row is read once per block and paired
# with every site of the block there (alpha, dl from the site's lse and S; the douts re-read per row from
# cache), its value path, key path and RMSNorm coupling summed in registers and added into G[j] with one fp32
# read + write (the last block, first in the backward, initialises G); row k, the block's own, is finished
# into dsrc. Every pair's dl goes into a table dl[n, NB + 1, H, P] (slot j: block row j, slot NB: the site's
# own partial row), and every pair's logit into a table z of the same layout; at the end _block_project_dl_kernel
# projects each site's dl sum out of dl (common._projected_dl) and one tensor-core pass forms A = sum over pairs
# and tokens of dl kr (dq = A g, dg = A q), as FullRouting's _query_grad_kernel does for its pair table.

@triton.jit
def _dl_offsets(site, slot, NB, P, H, zth):
    """Offsets of the dl table [n, NB + 1, H, P] for (site, slot) (site may be a tensor of sites) and a tile's zth
    = h * P + t offsets."""
    return ((tl.full([], 0, tl.int64) + site) * (NB + 1) + slot) * H * P + zth


@triton.jit(do_not_specialize=["site", "slot", "own_partial", "has_chain"])
def _block_site_bwd_kernel(
    rows_ptr, r_ptr, w_ptr, lse_ptr, dout_ptr, out_ptr, dout_ptrs_ptr, S_ptr, dl_ptr, z_ptr, chain_ptr, dsrc_ptr,
    site, slot, own_partial, has_chain, NB, P, D, H, K, dout_addr,
    BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr,
):
    """Site `site` (slot `slot` of its block): S = <dout, out> per head into S[slot]; if own_partial (its own
    row is a partial sum, read by no other site) that row's gradient into dsrc: the pair's, minus the RMSNorm
    coupling, plus chain (the next site's dsrc, storage dtype) if has_chain, and the pair's dl into the dl
    table (its logit into the logit table z); dout_addr into dout_ptrs[slot] for the block pass."""
    offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th = _full_row_tile(P, D, H, K, BLOCK_T, H_P, K_P)
    zth = tl.arange(0, H_P)[None, :] * P + offs_t[:, None].to(tl.int64)
    row_stride = (tl.full([], 0, tl.int64) + P) * D
    store_ty = rows_ptr.dtype.element_ty

    dout = tl.load(dout_ptr + tile, mask=mask, other=0.0).to(ACC)
    S = tl.sum(dout * tl.load(out_ptr + tile, mask=mask, other=0.0).to(ACC), axis=2)
    if own_partial != 0:
        v = tl.load(rows_ptr + site * row_stride + tile, mask=mask, other=0.0).to(ACC)
        r = tl.load(r_ptr + site * P + offs_t, mask=mask_t, other=0.0)
        w_HK = tl.load(w_ptr + site * D + col_HK, mask=mask_hk, other=0.0).to(ACC)
        lse = tl.load(lse_ptr + site * P * H + th, mask=mask_th, other=0.0)
        chain = tl.load(chain_ptr + tile, mask=mask & (has_chain != 0), other=0.0)
        kr = _to_storage(v * r[:, None, None], store_ty).to(ACC)
        dv, dl, c_th, logit = _pair_grads_per_head(v, kr, r, dout, w_HK[None, :, :], lse, S)
        dv += chain.to(ACC) - (r * r * tl.sum(c_th, axis=1) / D)[:, None, None] * v
        tl.store(dsrc_ptr + tile, _to_storage(dv, dsrc_ptr.dtype.element_ty), mask=mask)
        tl.store(dl_ptr + _dl_offsets(site, NB, NB, P, H, zth), dl, mask=mask_th)
        tl.store(z_ptr + _dl_offsets(site, NB, NB, P, H, zth), logit, mask=mask_th)
    tl.store(S_ptr + slot * P * H + th, S, mask=mask_th)
    if tl.program_id(0) == 0:  # the block pass finds this dout through the table
        tl.store(dout_ptrs_ptr + slot, dout_addr)


@triton.jit(do_not_specialize=["block", "s_lo", "n_slots", "span"])
def _block_pass_bwd_kernel(
    rows_ptr, r_ptr, w_ptr, lse_ptr, dout_ptrs_ptr, S_ptr, dl_ptr, z_ptr, g_ptr, dsrc_ptr,
    block, s_lo, n_slots, span, NB, P, D, H, K,
    LAST: tl.constexpr, BLOCK_T: tl.constexpr, H_P: tl.constexpr, K_P: tl.constexpr, ACC: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Block `block` (sites s_lo .. s_lo + n_slots - 1: their douts in dout_ptrs[0 .. n_slots), their S in
    S[0 .. n_slots)) is done. One program per token tile and block row j <= block (buffer row j * span; j
    varies fastest, so the block + 1 programs of a tile run together and share its douts in L2): the row's
    pairs with every site of the block (each pair's dl and logit into the dl and z tables), summed with the
    coupling into G[j] for j < block (LAST: the last block initialises G), and for j = block into dsrc with
    G[block]: that row is finished. (Its row R_{s_lo + 1} does not contain it, so no chain comes in; the site before
    reads this dsrc as its chain.)"""
    j = tl.program_id(0) % (block + 1)
    offs_t, mask_t, col_HK, mask_hk, tile, mask, th, mask_th = _full_row_tile_at(
        tl.program_id(0) // (block + 1), P, D, H, K, BLOCK_T, H_P, K_P)
    zth = tl.arange(0, H_P)[None, :] * P + offs_t[:, None].to(tl.int64)
    row_stride = (tl.full([], 0, tl.int64) + P) * D
    store_ty = rows_ptr.dtype.element_ty
    v = tl.load(rows_ptr + j * span * row_stride + tile, mask=mask, other=0.0).to(ACC)
    r = tl.load(r_ptr + j * span * P + offs_t, mask=mask_t, other=0.0)
    kr = _to_storage(v * r[:, None, None], store_ty).to(ACC)
    dv = tl.zeros([BLOCK_T, H_P, K_P], ACC)
    c = tl.zeros([BLOCK_T, H_P], ACC)  # per head; summed over the heads once, after the loop
    for slot in tl.range(0, n_slots, num_stages=STAGES):
        dout, S, lse, w = _block_site_state(dout_ptrs_ptr, S_ptr, lse_ptr, w_ptr, slot, s_lo, slot < n_slots,
                                            tile, mask, th, mask_th, col_HK, mask_hk, P, D, H, store_ty, ACC)
        dv_s, dl, c_s, logit = _pair_grads_per_head(v, kr, r, dout, w, lse, S)
        dv += dv_s
        c += c_s
        tl.store(dl_ptr + _dl_offsets(s_lo + slot, j, NB, P, H, zth), dl, mask=mask_th)
        tl.store(z_ptr + _dl_offsets(s_lo + slot, j, NB, P, H, zth), logit, mask=mask_th)
    dv -= (r * r * tl.sum(c, axis=1) / D)[:, None, None] * v
    if not LAST:
        dv += tl.load(g_ptr + j * row_stride + tile, mask=mask, other=0.0)
    tl.store(g_ptr + j * row_stride + tile, dv, mask=mask & (j < block))
    tl.store(dsrc_ptr + tile, _to_storage(dv, dsrc_ptr.dtype.element_ty), mask=mask & (j == block))


@triton.jit
def _block_site_state(dout_ptrs_ptr, S_ptr, lse_ptr, w_ptr, slot, s_lo, ok, tile, mask, th, mask_th, col_HK, mask_hk,
                      P, D, H, store_ty: tl.constexpr, ACC: tl.constexpr):
    """dout, S, lse and w (_site_w) of the block's site `slot`; where not ok (past the block's end)
    dout = S = 0 and lse = +inf, so that its pair is exactly zero (alpha = 0, dl = 0)."""
    dout = tl.load(_dout_rows(dout_ptrs_ptr, slot, ok, store_ty) + tile, mask=mask & ok, other=0.0).to(ACC)
    S = tl.load(S_ptr + slot * P * H + th, mask=mask_th & ok, other=0.0)
    lse = tl.load(lse_ptr + (s_lo + slot) * P * H + th, mask=mask_th & ok, other=float("inf"))
    w = _site_w(w_ptr, (s_lo + slot) * D, col_HK, mask_hk & ok, ACC)
    return dout, S, lse, w


@triton.jit(do_not_specialize=["span"])
def _block_query_grad_kernel(rows_ptr, r_ptr, dl_ptr, a_ptr, N, NB, span, P, D, H, K,
                             BLOCK_T: tl.constexpr, K_B: tl.constexpr, S_P: tl.constexpr, ACC: tl.constexpr,
                             PREC: tl.constexpr, STAGES: tl.constexpr):
    """A_s = sum over the rows s routes over and the tokens of dl(s, row) kr_row, per head, once at the end of
    the backward. One program: a token block, a head and a K_B-wide column slice. A block row rho = j * span
    < N - 1 is read by the sites rho..N-1 (dl slot j): a dl [sites, BLOCK_T] @ kr [BLOCK_T, K_B] tensor-core
    product. Any other row is a partial sum read by site rho only (dl slot NB): that site's dl [BLOCK_T] times
    kr, summed over the tokens on CUDA cores into the site's row of the partial (as a tensor-core product all
    rows but one would be zero: at 1B, 67 of the 73 rows, each a [128, 64] @ [64, 32] product in two bf16
    terms). The partial a[pid_t, sites, columns] is summed over token blocks on the host in a fixed order
    (as _query_grad_kernel)."""
    h = tl.program_id(1)
    offs_t, mask_t, offs_s, col, mask_b, tile, mask = _query_grad_tile(P, D, K, BLOCK_T, K_B, S_P)
    a = tl.zeros([S_P, K_B], ACC)
    # each site's dl rows of head h, slot 0 (sm_90: 151 -> 138 registers at 350M, 1B's 8-byte spill gone)
    dl_sites = dl_ptr + h * P + (offs_s.to(tl.int64) * (NB + 1) * H * P)[:, None] + offs_t[None, :]
    for j in range(0, NB):
        rho = j * span
        mask_s = (offs_s >= rho) & (offs_s < N)
        dl = tl.load(dl_sites + j * H * P, mask=mask_s[:, None] & mask_t[None, :], other=0.0)
        a = _query_grad_row(rows_ptr, r_ptr, rho, dl, a, offs_t, mask_t, tile, mask, P, D, ACC, PREC)
    own_dl = dl_ptr + (NB * H + h) * P + offs_t  # slot NB of site 0, head h
    for rho in tl.range(1, N, num_stages=STAGES):  # a block row's loads masked off (its slot NB is not written)
        partial = (rho % span != 0) | (rho == N - 1)
        dl = tl.load(own_dl + (tl.full([], 0, tl.int64) + rho) * (NB + 1) * H * P, mask=mask_t & partial, other=0.0)
        kr = _query_grad_kr(rows_ptr, r_ptr, rho, offs_t, mask_t & partial, tile, mask & partial, P, D, ACC).to(ACC)
        a += tl.where(offs_s[:, None] == rho, tl.sum(dl[:, None] * kr, axis=0)[None, :], 0.0)
    _query_grad_store(a_ptr, a, N, offs_s, col, mask_b, D)


@triton.jit(do_not_specialize=["span"])
def _block_project_dl_kernel(dl_ptr, z_ptr, lse_ptr, N, NB, span, P, H, BLOCK_T: tl.constexpr):
    """Every pair of site program_id(2), head program_id(1), token block program_id(0): dl in place with the
    site's dl sum over its rows projected out (_projected_dl), before _block_query_grad_kernel. The site reads
    the block rows j * span <= s (slots j < NB) and, where its own row is a partial sum, slot NB."""
    s = tl.program_id(2)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < P
    base = ((tl.full([], 0, tl.int64) + s) * (NB + 1) * H + tl.program_id(1)) * P + offs_t
    mask_own = mask_t & ((s % span != 0) | (s == N - 1))
    block_rows = tl.minimum(s // span + 1, NB)
    sigma = tl.load(dl_ptr + base + NB * H * P, mask=mask_own, other=0.0)
    for j in range(0, block_rows):
        sigma += tl.load(dl_ptr + base + j * H * P, mask=mask_t, other=0.0)
    lse = tl.load(lse_ptr + (s * P + offs_t.to(tl.int64)) * H + tl.program_id(1), mask=mask_t, other=0.0)
    for j in range(0, block_rows):
        _project_pair(dl_ptr, z_ptr, base + j * H * P, mask_t, lse, sigma)
    _project_pair(dl_ptr, z_ptr, base + NB * H * P, mask_own, lse, sigma)
