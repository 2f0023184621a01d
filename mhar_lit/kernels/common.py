"""Shared Triton helpers of the routing kernels (math: mhar_lit/routing/reference.py, docs/method.md B, C, I).

Layout. Every routed tensor is a stack of rows [rows, P, D] with P = B*T positions, row-major, contiguous.
Head h owns columns [h*K, (h+1)*K), K = D/H. Tiles are padded to powers of two (K_P, H_P) and masked.

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
S is taken from the output rounded to the storage dtype; dl is projected (_projected_dl) before A is formed:
the source gradients tolerate that rounding, A does not.

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
def _pair_grads_per_head(v, kr, r, dout, w, lse, S):
    """One (site, source) pair on full-row tiles: the source gradient before the RMSNorm coupling (value path +
    per-head key path: alpha dout + r dl w), the pair's dl [BLOCK_T, H_P] and its coupling per head, dl logit
    [BLOCK_T, H_P], not yet summed over the heads (a sum that crosses warps: a loop over pairs sums it once,
    after the loop), and its logit (for _projected_dl). w: the site's w_HK as [1, H_P, K_P] or as a full
    [BLOCK_T, H_P, K_P] tile (_site_w)."""
    logit = tl.sum(kr * w, axis=2)  # [BLOCK_T, H_P]
    alpha = tl.exp(logit - lse)
    dl = alpha * (tl.sum(dout * v, axis=2) - S)
    dv = alpha[:, :, None] * dout + (dl * r[:, None])[:, :, None] * w
    return dv, dl, dl * logit, logit


@triton.jit
def _site_w(w_ptr, base, col_HK, mask_hk, ACC: tl.constexpr):
    """A site's w = q g (its row starts at `base`) as a [1, H_P, K_P] tile, broadcastable to the
    [BLOCK_T, H_P, K_P] row tile."""
    return tl.load(w_ptr + base + col_HK, mask=mask_hk, other=0.0).to(ACC)[None, :, :]


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
def _projected_dl(dl, logit, lse, sigma):
    """A pair's dl with the sum over its site's sources projected out: dl - alpha * sigma, where sigma is that
    sum. In exact arithmetic sum_j dl_j = sum_j alpha_j (gdot_j - S) = 0 with S = <dout, out>; the backward
    takes S from the output rounded to the storage dtype, so in bf16 each site's dl sum is
    <dout, out - round(out)> (~2^-9 |dout| |out| / sqrt(K)), and that shift of every pair by alpha times it
    does not cancel in dq/dg = sum dl kr (3-5x eager's error; in the source gradients it enters only through the
    small key path). dl - alpha sigma = alpha (gdot - sum_i alpha_i gdot_i): S in fp32, as eager PyTorch has it.
    Masked lanes: dl 0 and sigma 0."""
    return dl - tl.exp(logit - lse) * sigma


@triton.jit
def _project_pair(dl_ptr, z_ptr, offs, mask, lse, sigma):
    """One pair's dl in place through _projected_dl (its logit from the logit table z, same layout as dl)."""
    dl = tl.load(dl_ptr + offs, mask=mask, other=0.0)
    logit = tl.load(z_ptr + offs, mask=mask, other=0.0)
    tl.store(dl_ptr + offs, _projected_dl(dl, logit, lse, sigma), mask=mask)


@triton.jit
def _query_grad_store(a_ptr, a, N, offs_s, col, mask_b, D):
    """This program's partial a [sites, columns] into a[token block, sites, columns]."""
    tl.store(a_ptr + (tl.program_id(0) * N + offs_s[:, None]).to(tl.int64) * D + col[None, :], a,
             mask=(offs_s[:, None] < N) & mask_b[None, :])
