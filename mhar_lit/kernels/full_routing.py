"""Chunked full-mode routing with cross-site reuse (docs/method.md B, C, I).

One `FullRouting` object lives for one forward pass of a full-mode model (the triton full router).
Sites s = 0..n-1 (n = 2L+1) are called in order; site s brings the newest source S_s and routes over
S_0..S_s. The pseudo-queries do not depend on the input, so every site's w_s = q_s * g_s is known up front.

Split of the work. Everything that contracts over sites or tokens runs as tensor-core products; the O(L^2)
passes over the rows are left with one or two FMAs per element and pair. With fp32 (or fp16) storage the
products are tf32x3 (fp32-accurate); with bf16 storage they take bf16 operands: the rows (and kr = round(v r))
are exact in bf16, and an fp32 operand (softmax weights, dl, w = q g) is split into two bf16 terms hi + lo,
leaving a relative error of ~2^-17 (2^-16 where both operands are split) against the result's own bf16
rounding of 2^-9. H200, 2026-12-04: the logits, key-path and dq/dg kernels 1.4-2x faster than with tf32x3,
whose lowering splits both operands again in every product (benchmarks/results/routing.md).
- Pair table z [N(N+1)/2, H, P]: every (source, site) logit, written once when the source arrives (a
  [P, K] @ [K, N - j] product per head). The backward's softmax gradient dl of every pair uses the same
  layout. Both are fp32 and d/H / 2 times smaller than one stack of the sources.
Forward. Sources go into one shared buffer rows[n, P, D] (storage dtype) with their RMS statistic r[n, P].
- At the first site s0 of a chunk of C sites, one prefix pass reads every older row [0, s0) once and mixes
  it into all C sites (the max is known from z, so there is no rescaling): one row read serves C sites.
- Each site then merges in only the in-chunk rows [s0, s] by log-sum-exp; it writes its output and lse.
Backward. Sources are grouped into groups of G. When the backward reaches the last site of a group, one
suffix pass reads the group's rows once and every later site's dout once: per pair one K-reduction
(<dout, v>) and one FMA (value path), as two small tensor-core products per token; it writes dl and the
group's partial gradients. Each site's backward then finishes its own
source with the in-group sites, either per head (column kernel, then a tensor-core pass that adds the key path
of all its pairs through the RMSNorm, dl @ w) or on full rows in one pass (tuning.COLUMN_IMPLS; by default
where heads are <= 128 wide, with the suffix pass doing its pairs' key path too). The douts are not copied: the tensors
autograd delivers are kept and the kernels find them through a table of their addresses (_dout_rows), which
each site's column kernel fills in for its own dout. dq, dg come from one tensor-core pass at the end
(sum over pairs and tokens of dl kr) with per-block partials summed on the host in a fixed order:
deterministic, no atomics. They are returned with the last backward call (site 0), which owns the full
query/key-norm parameters as autograd inputs.

Order contract: forward sites 0..n-1 exactly once each, backward in strict reverse order (autograd does
this, because every site's output feeds the next site's source). Anything else - activation checkpointing
that recomputes routing, a site whose output the loss does not use - raises. A retained graph may be
differentiated again (each backward restarts at the final site).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
from torch import Tensor

from mhar_lit.kernels import full_backward, full_forward
from mhar_lit.kernels.host import (accumulator, aligned, check_site_params, dot_dim, pow2, route_site,
                                   split_w, tile_tokens)
from mhar_lit.kernels.tuning import (DOT_TOKENS, PROJECT_TOKENS, SUFFIX_SITE_BLOCK, FullRoutingConfig, column_slice,
                                     dot_split, make_config)


# The suffix pass keeps a group's rows of a whole head in shared memory: on an H100 (2026-12-06,
# tests/test_gpu_routing_matrix.py) head widths of 512, 640 and 1280 in fp32 needed 394 / 459 / 918 KB of its 227 KB;
# 256 ran. 16-bit heads get fewer suffix tokens when wide (kernels.tuning.suffix_tokens_for); one token of a head
# wider than 2048 would still pass the budget (estimated: kernels.tuning.suffix_smem_bytes).
MAX_FP32_HEAD_WIDTH = 256
MAX_16BIT_HEAD_WIDTH = 2048


def max_head_width(dtype: torch.dtype) -> int:
    """The widest routing head full-mode Triton routing runs in `dtype` on the GPU."""
    return MAX_FP32_HEAD_WIDTH if dtype.itemsize >= 4 else MAX_16BIT_HEAD_WIDTH


def check_head_width(head_width: int, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before any kernel runs, a full-mode routing whose head is too wide for the GPU's shared memory."""
    widest = max_head_width(dtype)
    if device.type == "cuda" and head_width > widest:
        raise ValueError(
            f"full-mode Triton routing in {dtype} supports routing heads up to {widest} wide, this model's "
            f"are {head_width} (hidden size / heads): the backward's suffix pass would need more shared memory than "
            "the GPU has. " + ("Train in bf16-true, use" if dtype.itemsize >= 4 else "Use")
            + " more routing heads, or route on the PyTorch backend (--routing_backend.backend torch)")


class FullRouting:
    """State of chunked full-mode routing for one forward pass (see module docstring). `config`: a
    FullRoutingConfig, a mapping of its fields, or None for the measured defaults."""

    def __init__(self, embedding_BTD: Tensor, query_SD: Tensor, norm_weight_SD: Tensor, heads: int,
                 eps: float = 1e-6, config: Optional[Any] = None) -> None:
        check_site_params(embedding_BTD, query_SD, norm_weight_SD, heads)
        b, t, d = embedding_BTD.shape
        n = query_SD.shape[0]
        self.shape, self.n_sites, self.heads, self.eps = (b, t, d), n, heads, eps
        self.dtype, self.device = embedding_BTD.dtype, embedding_BTD.device
        check_head_width(d // heads, self.dtype, self.device)
        self.config = make_config(FullRoutingConfig, config).resolved(n, d, heads, self.dtype.itemsize)
        self.column_impl, self.chunk, self.group = self.config.column_impl, self.config.chunk, self.config.group
        self.acc_t, self.acc_tl = accumulator(self.dtype)
        self.p, self.k = b * t, d // heads
        self.h_p, self.k_p = pow2(heads), pow2(self.k)
        self.k_b = column_slice(self.k)  # column slice of the tensor-core products (logits, key path, dq/dg)
        self.k_split = dot_split(self.k)  # the suffix pass's head columns: two power-of-two slices
        self.k_w = self.config.column_width  # the forward passes' columns per program
        self.k_blocks = triton.cdiv(self.k, self.k_w)
        self.prec = "ieee" if self.acc_t == torch.float64 else "tf32x3"  # fp32-accurate tensor-core dots
        self.param_dtypes = (query_SD.dtype, norm_weight_SD.dtype)
        with torch.no_grad():
            self.q_SD = query_SD.detach().to(self.acc_t).clone()
            self.g_SD = norm_weight_SD.detach().to(self.acc_t).clone()
            self.w_SD = (self.q_SD * self.g_SD).contiguous()
            # w as the tensor-core operands of the logits and key-path kernels, split once here rather than in
            # every program: with bf16 storage two bf16 terms hi + lo (|w - hi - lo| <= 2^-17 |w|), otherwise w
            # itself twice
            self.w_terms = split_w(self.w_SD, self.dtype)[1]
        self.rows = torch.empty(n, self.p, d, dtype=self.dtype, device=self.device)
        self.r = torch.empty(n, self.p, dtype=self.acc_t, device=self.device)
        self.lse = torch.empty(n, self.p, heads, dtype=self.acc_t, device=self.device)
        # Every (source, site) logit of the forward, for the backward (source-major triangle, see
        # common._pair_row): N(N+1)/2 x H x P fp32, d/H / 2 times smaller than one pass of rows.
        self.z = torch.empty(n * (n + 1) // 2, heads, self.p, dtype=self.acc_t, device=self.device)
        self.next_site = 0
        self.next_backward = n - 1
        self._chunk_state: Optional[tuple[Tensor, Tensor, Tensor]] = None
        self._bwd: Optional[dict] = None

    # ---------------------------------------------------------------- public
    def route(self, site: int, source_BTD: Tensor, query_SD: Optional[Tensor] = None,
              norm_weight_SD: Optional[Tensor] = None) -> Tensor:
        """Output of `site`; `source_BTD` is the source that site brings (S_site). Site 0 must also get the
        full query and key-norm parameters so that autograd delivers their gradients there."""
        return route_site(self, site, source_BTD, query_SD, norm_weight_SD)

    def sources_view(self, upto: int) -> Tensor:
        """The first `upto` buffered sources as [N, B, T, D] (read-only use: monitors, during the forward)."""
        if self.rows is None:
            raise RuntimeError("the routing's source buffer was released by the end of its backward pass; "
                               "sources_view is for use during the forward pass")
        return self.rows[:upto].view(upto, *self.shape)

    def saved_state(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """What the backward needs beyond each site's output; autograd keeps it (save_for_backward of the
        final site), so it is freed with the graph, or kept for a second pass when the graph is retained."""
        return self.rows, self.r, self.lse, self.z

    def restore(self, rows: Tensor, r: Tensor, lse: Tensor, z: Tensor) -> None:
        self.rows, self.r, self.lse, self.z = rows, r, lse, z

    def release(self) -> None:
        """Drop the forward state: the graph's nodes keep this object alive as long as the loss is alive
        (a training loop's `loss` often survives into the next step's forward)."""
        self.rows = self.r = self.lse = self.z = None

    # ---------------------------------------------------------------- forward
    def forward_site(self, site: int, source_BTD: Tensor) -> Tensor:
        if site != self.next_site:
            raise RuntimeError(
                f"full-mode triton routing expected site {self.next_site}, got site {site}: sites must run once "
                "each, in order, per forward pass. Activation checkpointing that recomputes routing is not "
                "supported by this path (checkpoint only the sublayers, or use backend='torch')."
            )
        if source_BTD.shape != self.shape or source_BTD.dtype != self.dtype or source_BTD.device != self.device:
            raise ValueError(f"site {site}: source {tuple(source_BTD.shape)} {source_BTD.dtype} on "
                             f"{source_BTD.device} does not match {self.shape} {self.dtype} on {self.device}")
        self._append(site, source_BTD)
        s0 = site - site % self.chunk
        if site == s0 and s0 > 0:
            self._prefix(s0)
        d = self.shape[2]
        out_PD = torch.empty(self.p, d, dtype=self.dtype, device=self.device)
        m, l, acc = self._chunk_state if s0 > 0 else (self.lse, self.lse, self.lse)
        c_p = pow2(self.chunk)
        block_t = tile_tokens(c_p * self.k_w, self.config.tile_elements)  # the rows' [tokens, C_P, K_W] tile
        full_forward._merge_fwd_kernel[(triton.cdiv(self.p, block_t), self.heads, self.k_blocks)](
            self.rows, self.z, m, l, acc, out_PD, self.lse,
            s0, site, site - s0, self.n_sites, self.p, d, self.heads, self.k,
            HAS_INIT=s0 > 0, BLOCK_T=block_t, K_W=self.k_w, C_P=c_p, ACC=self.acc_tl,
            num_warps=self.config.num_warps,
        )
        self.next_site += 1
        if self.next_site == self.n_sites:
            self._chunk_state = None
        return out_PD.view(self.shape)

    def _append(self, site: int, source_BTD: Tensor) -> None:
        """Write source `site` into the buffer with its statistic, then its logits against every site >= site
        into the pair table (a tensor-core product per head: [P, K] @ [K, N - site])."""
        p, d, n = self.p, self.shape[2], self.n_sites
        d_p = pow2(d)
        block_t = tile_tokens(d_p, self.config.tile_elements)
        source = source_BTD.contiguous()
        full_forward._append_kernel[(triton.cdiv(p, block_t),)](
            source, self.rows, self.r, site, p, d, self.eps,
            BLOCK_T=block_t, D_P=d_p, ACC=self.acc_tl, num_warps=self.config.num_warps,
        )
        tokens = self.config.logits_tokens
        full_forward._logits_kernel[(triton.cdiv(p, tokens), self.heads)](
            self.rows, self.r, *self.w_terms, self.z, site, n, p, d, self.heads, self.k,
            BLOCK_T=tokens, K_B=self.k_b, S_P=dot_dim(n - site), ACC=self.acc_tl, PREC=self.prec, num_warps=4,
        )

    def _prefix(self, s0: int) -> None:
        """Mix rows [0, s0) into the chunk's sites once; leave (m, l, acc) per site."""
        c = min(self.chunk, self.n_sites - s0)
        if self._chunk_state is None:
            d = self.shape[2]
            self._chunk_state = (
                torch.empty(self.chunk, self.p, self.heads, dtype=self.acc_t, device=self.device),
                torch.empty(self.chunk, self.p, self.heads, dtype=self.acc_t, device=self.device),
                torch.empty(self.chunk, self.p, d, dtype=self.acc_t, device=self.device),
            )
        m, l, acc = self._chunk_state
        cfg = self.config
        full_forward._prefix_fwd_kernel[(triton.cdiv(self.p, cfg.prefix_tokens), self.heads, self.k_blocks)](
            self.rows, self.z, m, l, acc,
            s0, s0, c, self.n_sites, self.p, self.shape[2], self.heads, self.k,
            C_P=pow2(self.chunk), BLOCK_T=cfg.prefix_tokens, K_W=self.k_w, ACC=self.acc_tl, UNROLL=cfg.prefix_unroll,
            R_B=cfg.prefix_row_block(), STAGES=cfg.prefix_stages, num_warps=cfg.prefix_warps,
        )

    # ---------------------------------------------------------------- backward
    def backward_site(self, site: int, out_BTD: Tensor, dout_BTD: Tensor):
        if site == self.n_sites - 1:  # a (re)start: retain_graph lets autograd run the backward again
            self.next_backward, self._bwd = site, None
        if site != self.next_backward:
            raise RuntimeError(
                f"full-mode triton routing expected the backward of site {self.next_backward}, got site {site}: "
                "the backward must visit every site once, in reverse order (is the output of some site unused "
                "by the loss, or is the graph being differentiated twice?)"
            )
        if self.next_site != self.n_sites:
            raise RuntimeError(f"backward started after {self.next_site} of {self.n_sites} sites: the forward "
                               "pass did not reach the final routing site")
        if self._bwd is None:
            self._bwd = self._backward_buffers()
        g0 = site - site % self.group
        g_end = min(g0 + self.group, self.n_sites)
        if site == g_end - 1 and g_end < self.n_sites:
            self._suffix(g0, g_end)
        dsrc_PD = self._column(site, g0, g_end, out_BTD, dout_BTD)
        self.next_backward -= 1
        if site > 0:
            return dsrc_PD.view(self.shape), None, None
        a_SD = self._query_grad()  # every pair's dl exists now
        dq = (a_SD * self.g_SD).to(self.param_dtypes[0])
        dg = (a_SD * self.q_SD).to(self.param_dtypes[1])
        self._bwd = None
        self.release()  # a retained graph's rerun restores the state from the final site's saved tensors
        return dsrc_PD.view(self.shape), dq, dg

    def _backward_buffers(self) -> dict:
        n, p, d, h = self.n_sites, self.p, self.shape[2], self.heads
        dev, acc_t = self.device, self.acc_t
        return {
            # every site's dout as delivered by autograd, kept alive here and found by the kernels through a table
            # of their addresses (each column kernel enters its own): no copy into a buffer of all douts
            "douts": [None] * n,
            "dout_ptrs": torch.zeros(n, dtype=torch.int64, device=dev),
            "S": torch.empty(n, p, h, dtype=acc_t, device=dev),
            "dl": torch.empty_like(self.z),  # softmax gradient of every pair, same layout as the logits
            # the suffix pass's value-path partials of a group (none when one group holds every site)
            "part_dv": torch.empty(self.group, p, d, dtype=acc_t, device=dev) if self.group < n else None,
            # per-head column kernels only: the fp32 value-path gradient and the RMSNorm coupling per head
            "dvp": torch.empty(p, d, dtype=acc_t, device=dev) if self.column_impl == "head" else None,
            "c": torch.empty(h, p, dtype=acc_t, device=dev) if self.column_impl == "head" else None,
            # the row kernel's suffix pairs' RMSNorm coupling, from the "dot" suffix pass (suffix_keys)
            "part_c": torch.empty(self.group, p, h, dtype=acc_t, device=dev)
            if self.group < n and self.column_impl == "row" else None,
        }

    def _suffix(self, g0: int, g_end: int) -> None:
        """Value path and dl of all sites >= g_end against the sources [g0, g_end), one read of each. For the
        full-row column kernel it also does its pairs' key path and coupling (into part_dv and part_c: a third
        product per token), so that the row kernel reads no suffix pair."""
        bw, d, cfg = self._bwd, self.shape[2], self.config
        keys = self.column_impl == "row"
        key_args = (self.r, *self.w_terms, bw["part_c"]) if keys else (self.r, self.r, self.r, self.r)
        full_backward._suffix_dot_bwd_kernel[(triton.cdiv(self.p, cfg.suffix_tokens), self.heads)](
            self.rows, self.lse, bw["S"], bw["dout_ptrs"], self.z, bw["dl"], bw["part_dv"],
            g0, g_end - g0, g_end, self.n_sites, self.n_sites, self.p, d, self.heads, self.k, *key_args,
            G_P=dot_dim(self.group), BLOCK_T=cfg.suffix_tokens, K_A=self.k_split[0], K_B=self.k_split[1],
            S_B=SUFFIX_SITE_BLOCK, ACC=self.acc_tl, PREC=self.prec, KEYPATH=keys, num_warps=cfg.suffix_warps,
        )

    def _column(self, site: int, g0: int, g_end: int, out_BTD: Tensor, dout_BTD: Tensor) -> Tensor:
        """Finish source `site`: in-group pairs and value path, then the key path of all its pairs."""
        bw, p, d, n = self._bwd, self.p, self.shape[2], self.n_sites
        dout = dout_BTD.to(self.dtype).contiguous()
        if not aligned(dout):  # the kernels read the table's douts as 16-byte aligned rows (_dout_rows)
            dout = dout.clone()
        bw["douts"][site] = dout  # the later passes read it through bw["dout_ptrs"]
        if self.column_impl == "row":
            return self._column_rows(site, g0, g_end, out_BTD, dout)
        cfg = self.config
        block_t = cfg.column_tokens
        full_backward._column_bwd_kernel[(triton.cdiv(p, block_t), self.heads)](
            self.rows, self.lse, bw["S"], bw["dout_ptrs"], dout, out_BTD,
            self.z, bw["dl"], self._part_dv(g_end), bw["dvp"], bw["c"],
            site, g_end, site - g0, n, p, d, self.heads, self.k, dout.data_ptr(),
            HAS_SUFFIX=g_end < n, BLOCK_T=block_t, K_P=self.k_p, S_P=dot_dim(n - g_end),
            J_B=min(cfg.column_sites, pow2(self.group)), ACC=self.acc_tl, num_warps=cfg.column_warps,
        )
        dsrc_PD = torch.empty(p, d, dtype=self.dtype, device=self.device)
        full_backward._keypath_kernel[(triton.cdiv(p, cfg.keypath_tokens), self.heads)](
            self.rows, self.r, *self.w_terms, bw["dl"], bw["dvp"], bw["c"], dsrc_PD, site, n, p, d, self.heads,
            self.k,
            BLOCK_T=cfg.keypath_tokens, K_B=self.k_b, S_P=dot_dim(n - site), H_P=self.h_p, ACC=self.acc_tl,
            PREC=self.prec, num_warps=cfg.keypath_warps,
        )
        return dsrc_PD

    def _part_dv(self, g_end: int) -> Tensor:
        """The suffix pass's partials for a column kernel; without a suffix (g_end == n) the kernel reads none,
        and any tensor stands in for the pointer (there is no part_dv buffer when one group holds every site)."""
        return self._bwd["part_dv"] if g_end < self.n_sites else self._bwd["S"]

    def _part_c(self, g_end: int) -> Tensor:
        """The suffix pass's coupling partials for the row kernel (S stands in where there is no suffix pass,
        and then there is no part_c buffer)."""
        part_c = self._bwd["part_c"]
        return part_c if g_end < self.n_sites and part_c is not None else self._bwd["S"]

    def _column_rows(self, site: int, g0: int, g_end: int, out_BTD: Tensor, dout: Tensor) -> Tensor:
        """_column with full-row programs (column_impl "row"): one kernel, no fp32 round trip."""
        bw, p, d, n = self._bwd, self.p, self.shape[2], self.n_sites
        dsrc_PD = torch.empty(p, d, dtype=self.dtype, device=self.device)
        full_backward._column_row_bwd_kernel[(triton.cdiv(p, self.config.column_tokens),)](
            self.rows, self.r, self.w_SD, self.lse, bw["S"],
            bw["dout_ptrs"], dout, out_BTD,
            self.z, bw["dl"], self._part_dv(g_end), self._part_c(g_end), dsrc_PD,
            site, g_end, site - g0, n, p, d, self.heads, self.k, dout.data_ptr(),
            HAS_SUFFIX=g_end < n, BLOCK_T=self.config.column_tokens, H_P=self.h_p, K_P=self.k_p, ACC=self.acc_tl,
            num_warps=self.config.column_warps,
        )
        return dsrc_PD

    def _query_grad(self) -> Tensor:
        """A [N, D] from every pair's dl and kr (two launches once all dl exist); dq = A g, dg = A q."""
        bw, p, d, n = self._bwd, self.p, self.shape[2], self.n_sites
        # S came from the rounded outputs: project each site's dl sum out first (common._projected_dl)
        full_backward._project_dl_kernel[(triton.cdiv(p, PROJECT_TOKENS), self.heads, n)](
            bw["dl"], self.z, self.lse, n, p, self.heads, BLOCK_T=PROJECT_TOKENS, num_warps=2)
        blocks = triton.cdiv(p, DOT_TOKENS)
        a_part = torch.empty(blocks, n, d, dtype=self.acc_t, device=self.device)
        full_backward._query_grad_kernel[(blocks, self.heads, triton.cdiv(self.k, self.k_b))](
            self.rows, self.r, bw["dl"], a_part, n, p, d, self.heads, self.k,
            BLOCK_T=DOT_TOKENS, K_B=self.k_b, S_P=dot_dim(n), ACC=self.acc_tl, PREC=self.prec, num_warps=4,
        )
        return a_part.sum(0)
