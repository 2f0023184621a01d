"""Block-mode routing over one shared row buffer (the triton block router; docs/method.md D).

One `BlockRouting` object lives for one forward pass. Site s (0..n-1, n = 2L+1, called in order) brings
y_{s-1} (site 0: the embedding); the kernel forms the block's running partial sum R_s in the buffer itself
(see kernels/block.py), so a site's forward is one launch and one autograd node: no stack of the sources per site, no
separate partial-sum add, no copies of the block sums. Each site reads the completed block rows and its own
row once; the statistic of a block row is taken once, when the row is written.

Backward: strict reverse order (autograd's, since every site's output feeds the next site's row). Per site a
light kernel: S = <dout, out> per head, and a row that is not a block row (a partial sum, read by its own site
only) finished at once; the gradient that flows into it from the next partial sum is the dsrc the next site
returned, kept for it. A block row is read by every later site: at a block's first site one pass reads each
block row j <= k once, pairs it with all the block's sites (their douts are the tensors autograd delivered,
found through a table of addresses: no copy), adds the block's share into the fp32 block-row gradients G and
finishes the block's own row. Every pair's softmax gradient dl is kept, and one tensor-core pass at the end
gives dq, dg (per-token-block partials summed on the host in a fixed order): deterministic, no atomics.

Order contract as in FullRouting: activation checkpointing that recomputes routing, or a backward that does
not start at the final site, raises. A retained graph may be differentiated again. (An intermediate site
whose output nothing uses ends autograd's walk early without an error, in FullRouting too; every site of a
model feeds the next sublayer, so only hand-built stacks can do that.)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
from torch import Tensor

from mhar_lit.kernels import block as block_kernels
from mhar_lit.kernels.host import (accumulator, aligned, check_site_params, check_storage_dtype, pow2,
                                   route_site, split_w, tile_tokens)
from mhar_lit.kernels.tuning import (BLOCK_PASS_WARPS, PIPELINE_STAGES, PIPELINED_FORWARD_MIN_TOKENS,
                                     PROJECT_TOKENS, QUERY_GRAD_TOKENS, BlockRoutingConfig, column_slice,
                                     make_config)


class BlockRouting:
    """State of block-mode routing for one forward pass (see module docstring). `span` = sites per block
    (2 x layers per block); the final site (n - 1) belongs to the last block. `config`: a BlockRoutingConfig,
    a mapping of its fields, or None for the measured defaults."""

    def __init__(self, embedding_BTD: Tensor, query_SD: Tensor, norm_weight_SD: Tensor, heads: int, span: int,
                 eps: float = 1e-6, config: Optional[Any] = None) -> None:
        check_site_params(embedding_BTD, query_SD, norm_weight_SD, heads)
        b, t, d = embedding_BTD.shape
        n = query_SD.shape[0]
        if span < 2 or span % 2 or (n - 1) % span:
            raise ValueError(f"sites per block ({span}) must be an even number that divides the {n - 1} "
                             "layer sites")
        cfg = self.config = make_config(BlockRoutingConfig, config)
        self.shape, self.n_sites, self.heads, self.eps, self.span = (b, t, d), n, heads, eps, span
        self.dtype, self.device = embedding_BTD.dtype, embedding_BTD.device
        self.acc_t, self.acc_tl = accumulator(self.dtype)
        self.p, self.k = b * t, d // heads
        self.h_p, self.k_p = pow2(heads), pow2(self.k)
        self.block_t = tile_tokens(self.h_p * self.k_p, cfg.tile_elements)
        self.programs = triton.cdiv(self.p, self.block_t)
        self.num_warps = cfg.num_warps or (8 if self.block_t == 1 else 4)
        # the block pass may tile differently (its programs hold more state: a row, its keys, dv and a dout)
        self.pass_block_t = tile_tokens(self.h_p * self.k_p, cfg.pass_tile_elements or cfg.tile_elements)
        self.pass_programs = triton.cdiv(self.p, self.pass_block_t)
        self.pass_warps = cfg.pass_warps or BLOCK_PASS_WARPS
        self.fwd_stages = cfg.stages or (PIPELINE_STAGES if self.block_t >= PIPELINED_FORWARD_MIN_TOKENS else 1)
        self.pass_stages = cfg.stages or 1
        self.query_grad_stages = cfg.stages or PIPELINE_STAGES
        self.k_b = column_slice(self.k)  # column slice of the dq/dg pass (as FullRouting's)
        self.prec = "ieee" if self.acc_t == torch.float64 else "tf32x3"  # fp32-accurate tensor-core dots
        self.param_dtypes = (query_SD.dtype, norm_weight_SD.dtype)
        with torch.no_grad():
            self.q_SD = query_SD.detach().to(self.acc_t).clone()
            self.g_SD = norm_weight_SD.detach().to(self.acc_t).clone()
            # w = q g, with bf16 rows rounded to 16 significant bits as FullRouting's tensor-core operands are
            # (host.split_w); every kernel uses that same value
            self.w_SD = split_w(self.q_SD * self.g_SD, self.dtype)[0]
        self.rows = torch.empty(n, self.p, d, dtype=self.dtype, device=self.device)
        self.r = torch.empty(n, self.p, dtype=self.acc_t, device=self.device)
        self.lse = torch.empty(n, self.p, heads, dtype=self.acc_t, device=self.device)
        self.next_site = 0
        self.next_backward = n - 1
        self._bwd: Optional[dict] = None

    # ---------------------------------------------------------------- site structure
    def is_block_start(self, site: int) -> bool:
        return site < self.n_sites - 1 and site % self.span == 0

    def block_rows_before(self, site: int) -> int:
        """How many completed block rows (at 0, span, 2 span, ...) lie before `site`'s own row."""
        return -(-site // self.span)

    def source_rows(self, site: int) -> list[int]:
        """Buffer rows `site` routes over, in the reference's order: block rows, then its own row."""
        return [j * self.span for j in range(self.block_rows_before(site))] + [site]

    # ---------------------------------------------------------------- public
    def route(self, site: int, new_BTD: Tensor, query_SD: Optional[Tensor] = None,
              norm_weight_SD: Optional[Tensor] = None) -> Tensor:
        """Output of `site`; `new_BTD` is y_{site-1}, the previous sublayer's output (site 0: the embedding).
        Site 0 must also get the full query and key-norm parameters (autograd delivers their gradients
        there)."""
        return route_site(self, site, new_BTD, query_SD, norm_weight_SD)

    def sources_view(self, site: int) -> Tensor:
        """The sources of `site` as [N, B, T, D] (a copy; monitors, during the forward)."""
        if self.rows is None:
            raise RuntimeError("the routing's row buffer was released by the end of its backward pass; "
                               "sources_view is for use during the forward pass")
        if site >= self.next_site:
            raise RuntimeError(f"site {site} has not been routed yet")
        return self.rows[self.source_rows(site)].view(-1, *self.shape)

    def saved_state(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.rows, self.r, self.lse

    def restore(self, rows: Tensor, r: Tensor, lse: Tensor) -> None:
        self.rows, self.r, self.lse = rows, r, lse

    def release(self) -> None:
        self.rows = self.r = self.lse = None

    # ---------------------------------------------------------------- forward
    def forward_site(self, site: int, new_BTD: Tensor) -> Tensor:
        if site != self.next_site:
            raise RuntimeError(
                f"block-mode triton routing expected site {self.next_site}, got site {site}: sites must run once "
                "each, in order, per forward pass. Activation checkpointing that recomputes routing is not "
                "supported by this path (checkpoint only the sublayers, or use backend='torch')."
            )
        if new_BTD.shape != self.shape or new_BTD.device != self.device:
            raise ValueError(f"site {site}: input {tuple(new_BTD.shape)} on {new_BTD.device} does not match "
                             f"{self.shape} on {self.device}")
        check_storage_dtype(new_BTD.dtype)
        d = self.shape[2]
        new = new_BTD.contiguous()
        add_prev = int(site > 0 and not self.is_block_start(site - 1))
        out_PD = torch.empty(self.p, d, dtype=self.dtype, device=self.device)
        block_kernels._block_fwd_kernel[(self.programs,)](
            new, self.rows, self.r, self.w_SD, out_PD, self.lse,
            site, self.block_rows_before(site), self.span, add_prev, self.p, d, self.heads, self.k, self.eps,
            BLOCK_T=self.block_t, H_P=self.h_p, K_P=self.k_p, ACC=self.acc_tl,
            STAGES=self.fwd_stages, num_warps=self.num_warps,
        )
        self.next_site += 1
        return out_PD.view(self.shape)

    # ---------------------------------------------------------------- backward
    def backward_site(self, site: int, out_BTD: Tensor, dout_BTD: Tensor):
        n = self.n_sites
        if site == n - 1:  # a (re)start: retain_graph lets autograd run the backward again
            self.next_backward, self._bwd = site, None
        if site != self.next_backward:
            raise RuntimeError(
                f"block-mode triton routing expected the backward of site {self.next_backward}, got site {site}: "
                "the backward must visit every site once, in reverse order (is the output of some site unused "
                "by the loss, or is the graph being differentiated twice?)"
            )
        if self.next_site != n:
            raise RuntimeError(f"backward started after {self.next_site} of {n} sites: the forward pass did "
                               "not reach the final routing site")
        if self._bwd is None:
            self._bwd = self._backward_buffers()
        bw, p, d = self._bwd, self.p, self.shape[2]
        dout = dout_BTD.to(self.dtype).contiguous()
        if not aligned(dout):  # the block pass reads the table's douts as 16-byte aligned rows (_dout_rows)
            dout = dout.clone()
        dsrc_PD = torch.empty(p, d, dtype=self.dtype, device=self.device)
        self._site_backward(site, out_BTD, dout, dsrc_PD)
        bw["next_dsrc"] = dsrc_PD  # the gradient of R_site: the chain of site - 1 if R_site contains R_{site-1}
        self.next_backward -= 1
        if site > 0:
            return dsrc_PD.view(self.shape), None, None
        a_SD = self._query_grad()  # every pair's dl exists now
        dq = (a_SD * self.g_SD).to(self.param_dtypes[0])
        dg = (a_SD * self.q_SD).to(self.param_dtypes[1])
        self._bwd = None
        self.release()  # a retained graph's rerun restores the state from the final site's saved tensors
        return dsrc_PD.view(self.shape), dq, dg

    def _site_backward(self, site: int, out_BTD: Tensor, dout: Tensor, dsrc_PD: Tensor) -> None:
        bw, n, start = self._bwd, self.n_sites, self.is_block_start(site)
        blocks = self.block_rows_before(n - 1)
        block = min(site, n - 2) // self.span
        s0 = block * self.span
        dims = (self.p, self.shape[2], self.heads, self.k)
        has_chain = not start and site < n - 1
        bw["douts"][site - s0] = dout  # the block pass reads it through bw["dout_ptrs"]
        block_kernels._block_site_bwd_kernel[(self.programs,)](
            self.rows, self.r, self.w_SD, self.lse, dout, out_BTD, bw["dout_ptrs"], bw["S"], bw["dl"], bw["z"],
            bw["next_dsrc"] if has_chain else dsrc_PD, dsrc_PD, site, site - s0, int(not start), int(has_chain),
            blocks, *dims, dout.data_ptr(),
            BLOCK_T=self.block_t, H_P=self.h_p, K_P=self.k_p, ACC=self.acc_tl,
            num_warps=self.num_warps,
        )
        if not start:
            return
        slots = (n - s0) if block == blocks - 1 else self.span
        grid = (self.pass_programs * (block + 1),)  # a program per tile and row
        block_kernels._block_pass_bwd_kernel[grid](
            self.rows, self.r, self.w_SD, self.lse,
            bw["dout_ptrs"], bw["S"], bw["dl"], bw["z"], bw["G"], dsrc_PD, block, s0, slots, self.span, blocks, *dims,
            LAST=block == blocks - 1, BLOCK_T=self.pass_block_t, H_P=self.h_p, K_P=self.k_p, ACC=self.acc_tl,
            STAGES=self.pass_stages, num_warps=self.pass_warps,
        )
        bw["douts"] = [None] * len(bw["douts"])  # the block's douts are read; the block before fills the table

    def _query_grad(self) -> Tensor:
        """A [n, D] from every pair's dl and kr (two launches once all dl exist); dq = A g, dg = A q."""
        bw, p, d, n = self._bwd, self.p, self.shape[2], self.n_sites
        # S came from the rounded outputs: project each site's dl sum out first (common._projected_dl)
        block_kernels._block_project_dl_kernel[(triton.cdiv(p, PROJECT_TOKENS), self.heads, n)](
            bw["dl"], bw["z"], self.lse, n, self.block_rows_before(n - 1), self.span, p, self.heads,
            BLOCK_T=PROJECT_TOKENS, num_warps=2)
        token_blocks = triton.cdiv(p, QUERY_GRAD_TOKENS)
        a_part = torch.empty(token_blocks, n, d, dtype=self.acc_t, device=self.device)
        block_kernels._block_query_grad_kernel[(token_blocks, self.heads, triton.cdiv(self.k, self.k_b))](
            self.rows, self.r, bw["dl"], a_part, n, self.block_rows_before(n - 1), self.span, p, d, self.heads,
            self.k,
            BLOCK_T=QUERY_GRAD_TOKENS, K_B=self.k_b, S_P=max(16, pow2(n)), ACC=self.acc_tl, PREC=self.prec,
            STAGES=self.query_grad_stages, num_warps=4,
        )
        return a_part.sum(0)

    def _backward_buffers(self) -> dict:
        n, p, d = self.n_sites, self.p, self.shape[2]
        blocks = self.block_rows_before(n - 1)
        acc = dict(dtype=self.acc_t, device=self.device)
        return {
            # one block's douts as autograd delivered them (the last block has span + 1 sites), kept alive here
            # until its block pass, which finds them through a table of their addresses: no copy
            "douts": [None] * (self.span + 1),
            "dout_ptrs": torch.zeros(self.span + 1, dtype=torch.int64, device=self.device),
            "S": torch.empty(self.span + 1, p, self.heads, **acc),  # one block's <dout, out> per head
            # every pair's softmax gradient: [site, slot] with slot j for block row j, blocks for the own partial
            "dl": torch.empty(n, blocks + 1, self.heads, p, **acc),
            # every pair's logit, same layout: each site's dl sum is projected out with it before dq/dg (_projected_dl)
            "z": torch.empty(n, blocks + 1, self.heads, p, **acc),
            # block rows' gradients, summed over the blocks reading them (the last block row is finished by the
            # last block's pass, the first in the backward, without one)
            "G": torch.empty(max(blocks - 1, 1), p, d, **acc),
            "next_dsrc": None,  # the dsrc of the site after the current one (the gradient of its partial sum)
        }
