"""Chunked full-mode routing with cross-site reuse (KERNELS.md; SPEC B, C, I).

One `FullRouting` object lives for one forward pass of a full-mode model (FullAttnRes, backend="triton").
Sites s = 0..n-1 (n = 2L+1) are called in order; site s brings the newest source S_s and routes over
S_0..S_s. The pseudo-queries do not depend on the input, so every site's (q, g) is known up front.

Forward. Sites are grouped into chunks of C. Sources go into one shared buffer rows[n, P, D] (storage
dtype) with their RMS statistic r[n, P], written once, when the site that brings them runs.
- At the first site s0 of a chunk, one prefix pass reads every older row [0, s0) once and scores it against
  all C sites of the chunk (per head), leaving each site's online-softmax state (m, l, acc): one row read
  serves C sites instead of one.
- Each site then folds in only the in-chunk rows [s0, s] (the newest one taken straight from its input,
  copied into the buffer by the same kernel) and writes its output and log-sum-exp [P, H].
Backward. Sources are grouped into groups of G. When the backward reaches the last site of a group, one
suffix pass reads the group's rows once and every later site's dout once, accumulating the group's
gradients (value path, per-head key path, coupling term) in registers; then each site's backward finishes
its own source row with the in-group sites and writes the gradient once, in the storage dtype.
dq, dg of every site come from per-program partials reduced on the host in a fixed order (deterministic,
no atomics) and are returned with the last backward call (site 0), which owns the full query/key-norm
parameters as autograd inputs.

Order contract: forward sites 0..n-1 exactly once each, backward in strict reverse order (autograd does
this, because every site's output feeds the next site's source). Anything else - activation checkpointing
that recomputes routing, a site whose output the loss does not use - raises. A retained graph may be
differentiated again (each backward restarts at the final site).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from torch import Tensor
from torch.autograd.function import once_differentiable

from mhar_lit.kernels import _routing_kernels as kern
from mhar_lit.kernels.routing_triton import (accumulator, check_device, check_storage_dtype, pow2,
                                             tile_tokens)

# Defaults = the best configuration measured on an H200 (benchmarks/results/routing.md, 2026-12-02):
# chunk 4 / group 8 / 2 warps / 2048-element tiles ran 16.8 / 27.5 / 35.9 ms at the 100M / 350M / 1B shapes
# against 15.3 / 32.4 / 134 ms for chunk 8 / group 4 / 4 warps / 4096.
DEFAULT_CHUNK = 4  # C: sites per forward prefix pass
DEFAULT_GROUP = 8  # G: sources per backward suffix pass
DEFAULT_WARPS = 2
DEFAULT_TILE = 2048  # elements of one register tile (fixes tokens per program)


class FullRouting:
    """State of chunked full-mode routing for one forward pass (see module docstring)."""

    def __init__(self, embedding_BTD: Tensor, query_SD: Tensor, norm_weight_SD: Tensor, heads: int,
                 eps: float = 1e-6, chunk: int = DEFAULT_CHUNK, group: int = DEFAULT_GROUP,
                 num_warps: int = DEFAULT_WARPS, tile_elements: int = DEFAULT_TILE) -> None:
        if embedding_BTD.dim() != 3:
            raise ValueError(f"embedding must be [B, T, D], got {tuple(embedding_BTD.shape)}")
        b, t, d = embedding_BTD.shape
        n = query_SD.shape[0]
        if query_SD.shape != (n, d) or norm_weight_SD.shape != (n, d):
            raise ValueError(f"query {tuple(query_SD.shape)} and norm_weight {tuple(norm_weight_SD.shape)} "
                             f"must both be (sites, {d})")
        if d % heads != 0:
            raise ValueError(f"hidden size {d} is not divisible by the number of routing heads {heads}")
        if chunk < 1 or group < 1:
            raise ValueError(f"chunk ({chunk}) and group ({group}) must be >= 1")
        check_storage_dtype(embedding_BTD.dtype)
        check_device(embedding_BTD, query_SD, norm_weight_SD)
        self.shape, self.n_sites, self.heads, self.eps = (b, t, d), n, heads, eps
        self.chunk, self.group, self.num_warps = min(chunk, n), min(group, n), num_warps
        self.tile = tile_elements  # register tile size: fixes tokens per program (tile_tokens)
        self.dtype, self.device = embedding_BTD.dtype, embedding_BTD.device
        self.acc_t, self.acc_tl = accumulator(self.dtype)
        self.p, self.k = b * t, d // heads
        self.h_p, self.k_p = pow2(heads), pow2(self.k)
        self.param_dtypes = (query_SD.dtype, norm_weight_SD.dtype)
        with torch.no_grad():
            self.q_SD = query_SD.detach().to(self.acc_t).clone()
            self.g_SD = norm_weight_SD.detach().to(self.acc_t).clone()
            self.w_SD = (self.q_SD * self.g_SD).contiguous()
        self.rows = torch.empty(n, self.p, d, dtype=self.dtype, device=self.device)
        self.r = torch.empty(n, self.p, dtype=self.acc_t, device=self.device)
        self.lse = torch.empty(n, self.p, heads, dtype=self.acc_t, device=self.device)
        self.outputs: list[Optional[Tensor]] = [None] * n
        self.next_site = 0
        self.next_backward = n - 1
        self._chunk_state: Optional[tuple[Tensor, Tensor, Tensor]] = None
        self._bwd: Optional[dict] = None

    # ---------------------------------------------------------------- public
    def route(self, site: int, source_BTD: Tensor, query_SD: Optional[Tensor] = None,
              norm_weight_SD: Optional[Tensor] = None) -> Tensor:
        """Output of `site`; `source_BTD` is the source that site brings (S_site). Site 0 must also get the
        full query and key-norm parameters so that autograd delivers their gradients there."""
        if site == 0 and (query_SD is None or norm_weight_SD is None):
            raise ValueError("site 0 must receive the full query and norm_weight parameters")
        return _FullSiteFunction.apply(self, site, source_BTD, query_SD, norm_weight_SD)

    def sources_view(self, upto: int) -> Tensor:
        """The first `upto` buffered sources as [N, B, T, D] (read-only use: monitors)."""
        return self.rows[:upto].view(upto, *self.shape)

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
        s0 = site - site % self.chunk
        if site == s0 and s0 > 0:
            self._prefix(s0)
        out_PD = torch.empty(self.p, self.shape[2], dtype=self.dtype, device=self.device)
        m, l, acc = self._chunk_state if s0 > 0 else (self.lse, self.lse, self.lse)
        block_t = tile_tokens(self.h_p * self.k_p, self.tile)
        kern._site_fwd_kernel[(triton.cdiv(self.p, block_t),)](
            self.rows, self.r, source_BTD.contiguous(), self.w_SD, m, l, acc, out_PD, self.lse[site],
            s0, site, site, site, site - s0, self.p, self.shape[2], self.heads, self.k, self.eps,
            HAS_INIT=s0 > 0, HAS_NEW=True, INLINE_R=False,
            BLOCK_T=block_t, H_P=self.h_p, K_P=self.k_p, ACC=self.acc_tl, num_warps=self.num_warps,
        )
        self.outputs[site] = out_PD
        self.next_site += 1
        if self.next_site == self.n_sites:
            self._chunk_state = None
        return out_PD.view(self.shape)

    def _prefix(self, s0: int) -> None:
        """Score rows [0, s0) against the chunk's sites once; leave (m, l, acc) per site."""
        c = min(self.chunk, self.n_sites - s0)
        if self._chunk_state is None:
            d = self.shape[2]
            self._chunk_state = (
                torch.empty(self.chunk, self.p, self.heads, dtype=self.acc_t, device=self.device),
                torch.empty(self.chunk, self.p, self.heads, dtype=self.acc_t, device=self.device),
                torch.empty(self.chunk, self.p, d, dtype=self.acc_t, device=self.device),
            )
        m, l, acc = self._chunk_state
        c_p = pow2(self.chunk)
        block_t = tile_tokens(c_p * self.k_p, self.tile)
        kern._prefix_fwd_kernel[(triton.cdiv(self.p, block_t), self.heads)](
            self.rows, self.r, self.w_SD, m, l, acc,
            s0, s0, c, self.p, self.shape[2], self.heads, self.k,
            C_P=c_p, BLOCK_T=block_t, K_P=self.k_p, ACC=self.acc_tl, num_warps=self.num_warps,
        )

    # ---------------------------------------------------------------- backward
    def backward_site(self, site: int, dout_BTD: Tensor):
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
        bw = self._bwd
        g0 = site - site % self.group
        g_end = min(g0 + self.group, self.n_sites)
        if site == g_end - 1:
            bw["has_suffix"] = g_end < self.n_sites
            if bw["has_suffix"]:
                self._suffix(g0, g_end)
        dsrc_PD = self._column(site, g0, g_end, dout_BTD)
        self.next_backward -= 1
        if site > 0:
            return dsrc_PD.view(self.shape), None, None
        a_SD = bw["a"]
        dq = (a_SD * self.g_SD).to(self.param_dtypes[0])
        dg = (a_SD * self.q_SD).to(self.param_dtypes[1])
        self._bwd = None  # forward state stays (freed with the graph) so that a retained graph can rerun
        return dsrc_PD.view(self.shape), dq, dg

    def _backward_buffers(self) -> dict:
        n, p, d, h = self.n_sites, self.p, self.shape[2], self.heads
        dev, acc_t = self.device, self.acc_t
        return {
            "dout": torch.empty(n, p, d, dtype=self.dtype, device=dev),
            "S": torch.empty(n, p, h, dtype=acc_t, device=dev),
            "part_dv": torch.empty(self.group, p, d, dtype=acc_t, device=dev),
            "part_c": torch.empty(self.group, p, h, dtype=acc_t, device=dev),
            "a": torch.zeros(n, d, dtype=acc_t, device=dev),
            "has_suffix": False,
        }

    def _suffix(self, g0: int, g_end: int) -> None:
        """Gradient contributions of all sites >= g_end to the sources [g0, g_end), one read of each."""
        bw, d = self._bwd, self.shape[2]
        g_p = pow2(self.group)
        block_t = tile_tokens(g_p * self.k_p, self.tile)
        programs = triton.cdiv(self.p, block_t)
        a_part = torch.empty(self.n_sites - g_end, programs, d, dtype=self.acc_t, device=self.device)
        kern._suffix_bwd_kernel[(programs, self.heads)](
            self.rows, self.r, self.w_SD, self.lse, bw["S"], bw["dout"], bw["part_dv"], bw["part_c"], a_part,
            g0, g_end - g0, g_end, self.n_sites, self.p, d, self.heads, self.k,
            G_P=g_p, BLOCK_T=block_t, K_P=self.k_p, ACC=self.acc_tl, num_warps=self.num_warps,
        )
        bw["a"][g_end:] += a_part.sum(1)

    def _column(self, site: int, g0: int, g_end: int, dout_BTD: Tensor) -> Tensor:
        """Finish source `site`: its suffix partial plus the pairs (s, site) for in-group sites s >= site."""
        bw, d = self._bwd, self.shape[2]
        block_t = tile_tokens(self.h_p * self.k_p, self.tile)
        programs = triton.cdiv(self.p, block_t)
        a_part = torch.empty(g_end - site, programs, d, dtype=self.acc_t, device=self.device)
        dsrc_PD = torch.empty(self.p, d, dtype=self.dtype, device=self.device)
        dout_PD = dout_BTD.to(self.dtype).contiguous()
        kern._site_bwd_kernel[(programs,)](
            self.rows, self.r, self.w_SD, self.lse, bw["S"], bw["dout"], dout_PD, self.outputs[site],
            bw["part_dv"], bw["part_c"], dsrc_PD, a_part[0], a_part[1:] if g_end - site > 1 else a_part,
            site, site + 1, site, site + 1, g_end, site - g0, self.p, d, self.heads, self.k,
            HAS_INIT=bw["has_suffix"], STORE_NEW=True,
            BLOCK_T=block_t, H_P=self.h_p, K_P=self.k_p, ACC=self.acc_tl, num_warps=self.num_warps,
        )
        bw["a"][site:g_end] += a_part.sum(1)
        return dsrc_PD


class _FullSiteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, routing: FullRouting, site: int, source_BTD: Tensor, query_SD: Optional[Tensor],
                norm_weight_SD: Optional[Tensor]) -> Tensor:
        ctx.routing, ctx.site = routing, site
        return routing.forward_site(site, source_BTD)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout_BTD: Tensor):
        dsrc, dq, dg = ctx.routing.backward_site(ctx.site, dout_BTD)
        return None, None, dsrc, dq, dg
