"""Chunked full-mode routing with cross-site reuse (KERNELS.md; SPEC B, C, I).

One `FullRouting` object lives for one forward pass of a full-mode model (FullAttnRes, backend="triton").
Sites s = 0..n-1 (n = 2L+1) are called in order; site s brings the newest source S_s and routes over
S_0..S_s. The pseudo-queries do not depend on the input, so every site's w_s = q_s * g_s is known up front.

Split of the work. Everything that contracts over sites or tokens runs as tensor-core products; the O(L^2)
passes over the rows are left with one or two FMAs per element and pair. With fp32 (or fp16) storage the
products are tf32x3 (fp32-accurate); with bf16 storage they take bf16 operands: the rows (and kr = round(v r))
are exact in bf16, and an fp32 operand (softmax weights, dl, w = q g) is split into two bf16 terms hi + lo,
leaving a relative error of ~2^-17 (2^-16 where both operands are split) against the result's own bf16
rounding of 2^-9. H200, 2026-12-04: the logits, key-path and dq/dg kernels 1.4-2x faster than with tf32x3,
whose lowering splits both operands again in every product (benchmarks/results/routing.md, session 9).
- Pair table z [N(N+1)/2, H, P]: every (source, site) logit, written once when the source arrives (a
  [P, K] @ [K, N - j] product per head). The backward's softmax gradient dl of every pair uses the same
  layout. Both are fp32 and d/H / 2 times smaller than one stack of the sources.
Forward. Sources go into one shared buffer rows[n, P, D] (storage dtype) with their RMS statistic r[n, P].
- At the first site s0 of a chunk of C sites, one prefix pass reads every older row [0, s0) once and mixes
  it into all C sites (the max is known from z, so there is no rescaling): one row read serves C sites.
- Each site then merges in only the in-chunk rows [s0, s] by log-sum-exp; it writes its output and lse.
Backward. Sources are grouped into groups of G. When the backward reaches the last site of a group, one
suffix pass reads the group's rows once and every later site's dout once: per pair one K-reduction
(<dout, v>) and one FMA (value path), by default as two small tensor-core products per token (see
PASS_IMPLS); it writes dl and the group's partial gradients. Each site's backward then finishes its own
source with the in-group sites, either per head (column kernel, then a tensor-core pass that adds the key path
of all its pairs through the RMSNorm, dl @ w) or on full rows in one pass (COLUMN_IMPLS; by default where heads
are <= 128 wide, with the suffix pass doing its pairs' key path too). The douts are not copied: the tensors
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

from typing import Optional

import torch
import triton
from torch import Tensor
from torch.autograd.function import once_differentiable

from mhar_lit.kernels import _routing_kernels as kern
from mhar_lit.kernels.launch import launch
from mhar_lit.kernels.routing_triton import (accumulator, check_device, check_storage_dtype, pow2, split_w,
                                             tile_tokens)

# Defaults from the H200 measurements of 2026-12-02 (benchmarks/results/routing.md): no single configuration
# of the v2 grid was best at every shape (100M: 4/8/2 warps/4096; 350M: 4/8/2/2048; 1B: 8/4/2/2048); these
# are the 350M best and within 1.35x of the best elsewhere (try-2 kernels). The suffix pass picks its own tokens and warps.
DEFAULT_CHUNK = 4  # C: sites per forward prefix pass
# G: sources per backward suffix pass at most (H200, 2026-12-04: 16 beat 8 and 12 with column_sites 2), spread
# evenly over the groups that needs (balanced_group): 350M's 49 sites as 4 groups of 13, not 16 + 16 + 16 + 1
# (captured routing 6.25 against 6.56 ms; 12: 6.40, 14: 6.33, 15: 6.42; session 12). Its fp32 value-path buffer
# is [G, tokens, d]; peak memory stayed at 1.02 / 1.04 / 1.04x the baseline (it is not alive at the peak).
DEFAULT_GROUP = 16
DEFAULT_WARPS = 2
DEFAULT_TILE = 2048  # elements of one register tile (fixes tokens per program)
DOT_TOKENS = 64  # tokens per program of the tensor-core kernels (logits, key path, dq/dg)
UNROLL_CHOICES = (1, 2, 4)
# Rows (prefix) / sites (suffix) whose loads the O(L^2) loops issue together. H200, 2026-12-02: unrolling by 4
# sped the prefix kernels up at every shape (1B: 2.88 -> 2.64 ms) but slowed the suffix kernels down at 1B
# (5.75 -> 10.80 ms: 255 registers with spills), so the two passes have separate knobs. The suffix's default
# (0) picks by head width: 4 up to 64 padded columns (100M, K 64: suffix 4.71 -> 3.72 ms; routing 13.5 ->
# 11.2 ms on 2026-12-03), 1 above (350M, K 128: 11.5 vs 16.9 ms with 4). Session 8 (column blocks, see
# column_block): prefix unroll 2 beat 4 at 100M (0.96 vs 1.10 ms) and 1B (2.34 vs 2.84), equal at 350M. Session 12
# (max over z in 16-row tiles since session 10: 90 registers at 1B), captured routing with unroll 4 / 2: 1B 8.01 /
# 8.30 ms, 100M 4.98 / 5.01, and 350M (pipelined prefix, below) 6.18 / 6.11. So the prefix's default (0) is 2 where
# the loop is pipelined (the async copies already keep loads in flight) and 4 elsewhere.
UNPIPELINED_PREFIX_UNROLL, PIPELINED_PREFIX_UNROLL = 4, 2
# The fma prefix's row loop software-pipelined (tl.range num_stages; 1: not): Triton then issues its loads as
# asynchronous copies into shared memory STAGES - 1 steps ahead, so the bytes in flight are not bounded by
# registers. H200, 2026-12-04 (session 12, call 8), captured routing with 3 stages: 350M (rows of 128 columns,
# 256 contiguous bytes per token) 6.26 -> 6.11 ms (prefix 1.40 -> 1.28); 100M (128 bytes) 5.02 -> 5.10; 1B (64-byte
# column blocks) 8.33 -> 10.29 (prefix 2.27 -> 4.21). So pipelined only from PIPELINE_MIN_BYTES contiguous bytes.
# (The column kernels' in-group loops pipelined the same way were slower at every shape: 100M 5.11-5.44, 350M
# 6.38-6.50, 1B 8.66-8.83 ms; not kept.)
PIPELINED_PREFIX_STAGES = 3
PIPELINE_MIN_BYTES = 256
DEFAULT_SUFFIX_UNROLL = 0
# The prefix (forward) and suffix (backward) passes each have a CUDA-core version ("fma": _prefix_fwd_kernel,
# _suffix_bwd_kernel) and a batched tensor-core one ("dot": _prefix_dot_fwd_kernel, _suffix_dot_bwd_kernel);
# same outputs to fp32 rounding. Defaults by the H200 measurement of 2026-12-03 (routing.md, session 6): the
# dot suffix is 1.6-3.9x faster, the dot prefix 1.4-2.4x slower (the chunk's sites padded to 16 rows).
PASS_IMPLS = ("fma", "dot")
DEFAULT_PREFIX_IMPL = "fma"
DEFAULT_SUFFIX_IMPL = "dot"
PREFIX_ROW_BLOCK = 16  # rows per step of the "dot" prefix (a tensor-core product's smallest size) and, at most,
# of the fma prefix's max loop (a [C_P, tokens, rows] tile of logits; fewer rows when the token tile is large)
SUFFIX_SITE_BLOCK = 16  # later sites per step of the "dot" suffix (likewise)
# In-group sites per step of the column kernel (their loads issued together). H200, 2026-12-04 (group 16): 2 beat
# 4 and 1 at every shape (captured routing 5.54 / 6.66 / 8.41 ms against 5.99 / 6.69 / 8.93 with 4 and group 8).
COLUMN_SITE_BLOCK = 2
# How a source's backward is finished: "row", one full-row program per token block (_column_row_bwd_kernel:
# in-group pairs, key path and the cross-head RMSNorm coupling in one pass, the key path as fp32 FMAs), or
# "head", per-head programs (_column_bwd_kernel) that leave the fp32 value-path gradient and the coupling in
# memory for a tensor-core key-path kernel (_keypath_kernel). H200, 2026-12-04 (routing.md, session 12): "row"
# with one group of all sites (no suffix pass, no fp32 part_dv / dvp round trips) wins at the 100M shape (K 64,
# 25 sites: routing kernels 4.99 vs 5.47 ms) and loses wherever sources have many later sites: with a suffix
# pass its per-site key-path loop re-reads w_s for every 2-token block (350M: 4.81 vs 2.66 ms of column work);
# as one group at 350M (49 sites) each source reads twice the douts (4.93 vs 3.50 ms); 1B's K 160 pads to 256.
# Session 13: with the "dot" suffix pass doing its pairs' key path and coupling too (KEYPATH: a third product per
# token there, into part_dv and part_c), the row kernel reads no suffix pair, and groups pay off for it: captured
# routing 100M 4.90 ms with row and group 13 against 4.99 with one group of 25; 350M 6.33 against 6.40 per head
# (call 1; 1B's row kernel, K 160 padded to 256: 9.11 against 8.62). So the default is "row" where the head width
# is a power of two <= 128 whose full row fits the row tile and the suffix pass is "dot" (or one group holds every
# site), with balanced groups as for "head"; else "head".
COLUMN_IMPLS = ("row", "head")
ROW_MAX_HEAD = 128
# The full-row kernel's tile: 1024 elements on 4 warps (8 per thread; 64 registers at 100M). H200, 100M: 2.52 ms
# against 2.71 (1024 on 2 warps), 2.74 (2048 on 4), 3.02 (4096 on 8); 32 per thread spills.
ROW_COLUMN_TILE = 1024
ROW_COLUMN_WARPS = 4
# row_dl_buffer: the row column kernel keeps its in-group pairs' dl in registers, [tokens, heads, pow2(group)],
# and stores them once, where pow2(group) <= this (else, and by default, per site: each store a layout conversion
# with two barriers). row_w_tile: it loads each site's w as a full tile in the rows' dtype (_site_w). Both remove
# shared memory from its site loop (sm_90 TTGIR, 2026-12-05); neither is timed yet, so both are off by default.
ROW_DL_BUFFER_MAX = 16

class FullRouting:
    """State of chunked full-mode routing for one forward pass (see module docstring).

    Knobs left at 0 / "" take the measured defaults. column_tokens / column_warps apply to whichever column
    kernel column_impl picks; their tiles differ ([tokens, J_B, K] per head, [tokens, H, K] per row), so a value
    tuned for one is not right for the other. The row kernel's tile is ROW_COLUMN_TILE, not tile_elements;
    prefix_stages and prefix_unroll apply to the fma prefix only."""

    def __init__(self, embedding_BTD: Tensor, query_SD: Tensor, norm_weight_SD: Tensor, heads: int,
                 eps: float = 1e-6, chunk: int = DEFAULT_CHUNK, group: int = 0,
                 num_warps: int = DEFAULT_WARPS, tile_elements: int = DEFAULT_TILE,
                 prefix_unroll: int = 0, suffix_unroll: int = DEFAULT_SUFFIX_UNROLL,
                 suffix_tokens: int = 0, suffix_warps: int = 0, suffix_impl: str = DEFAULT_SUFFIX_IMPL,
                 column_tokens: int = 0, column_warps: int = 0, prefix_impl: str = DEFAULT_PREFIX_IMPL,
                 prefix_tokens: int = 0, prefix_warps: int = 0, column_width: int = 0,
                 keypath_tokens: int = 0, keypath_warps: int = 0, keypath_width: int = 0,
                 column_sites: int = 0, column_impl: str = "", prefix_stages: int = 0,
                 logits_tokens: int = 0, row_w_tile: int = 0, row_dl_buffer: int = 0,
                 prefix_row_3d: int = 0, merge_tokens: int = 0) -> None:
        if embedding_BTD.dim() != 3:
            raise ValueError(f"embedding must be [B, T, D], got {tuple(embedding_BTD.shape)}")
        b, t, d = embedding_BTD.shape
        n = query_SD.shape[0]
        if query_SD.shape != (n, d) or norm_weight_SD.shape != (n, d):
            raise ValueError(f"query {tuple(query_SD.shape)} and norm_weight {tuple(norm_weight_SD.shape)} "
                             f"must both be (sites, {d})")
        if d % heads != 0:
            raise ValueError(f"hidden size {d} is not divisible by the number of routing heads {heads}")
        if chunk < 1 or group < 0:
            raise ValueError(f"chunk ({chunk}) must be >= 1 and group ({group}) >= 0 (0: automatic, "
                             "balanced_group)")
        if prefix_unroll not in (0, *UNROLL_CHOICES):
            raise ValueError(f"prefix_unroll must be one of {(0, *UNROLL_CHOICES)} (0: by pipelining), "
                             f"got {prefix_unroll}")
        if suffix_unroll not in (0, *UNROLL_CHOICES):
            raise ValueError(f"suffix_unroll must be one of {(0, *UNROLL_CHOICES)} (0: by head width), "
                             f"got {suffix_unroll}")
        for name, impl in (("prefix_impl", prefix_impl), ("suffix_impl", suffix_impl)):
            if impl not in PASS_IMPLS:
                raise ValueError(f"{name} must be one of {PASS_IMPLS}, got {impl!r}")
        if column_impl not in ("", *COLUMN_IMPLS):
            raise ValueError(f"column_impl must be one of {COLUMN_IMPLS} (or '' for the default by head width, "
                             f"row tile and suffix pass), got {column_impl!r}")
        for name, tokens, warps in (("suffix", suffix_tokens, suffix_warps), ("column", column_tokens, column_warps),
                                    ("prefix", prefix_tokens, prefix_warps),
                                    ("keypath", keypath_tokens, keypath_warps), ("logits", logits_tokens, 0),
                                    ("merge", merge_tokens, 0)):
            if tokens < 0 or tokens & (tokens - 1) or warps < 0:
                raise ValueError(f"{name}_tokens ({tokens}) must be 0 (automatic) or a power of two, "
                                 f"{name}_warps ({warps}) 0 (automatic) or positive")
        for name, value in (("row_w_tile", row_w_tile), ("row_dl_buffer", row_dl_buffer),
                            ("prefix_row_3d", prefix_row_3d)):
            if value not in (0, 1):
                raise ValueError(f"{name} must be 0 or 1, got {value}")
        check_storage_dtype(embedding_BTD.dtype)
        check_device(embedding_BTD, query_SD, norm_weight_SD)
        self.row_w_tile, self.row_dl_buffer = bool(row_w_tile), bool(row_dl_buffer)
        self.prefix_row_3d = bool(prefix_row_3d)  # the fma prefix loads its rows 3-D (_prefix_row); not yet timed
        # Tokens per merge program (0: from the tile, 8 at 100M). sm_90 (2026-12-05): its ~1000 instructions per
        # 8-token program are mostly per-program work (addresses, masks, the same per-token values loaded in
        # several layouts); 16 tokens take 1112. Not yet timed.
        self.merge_tokens = merge_tokens
        self.shape, self.n_sites, self.heads, self.eps = (b, t, d), n, heads, eps
        self.column_impl = column_impl or default_column_impl(d // heads, heads, group >= n, suffix_impl)
        group = group or balanced_group(n, DEFAULT_GROUP)
        self.chunk, self.group, self.num_warps = min(chunk, n), min(group, n), num_warps
        self.tile = tile_elements  # register tile size: fixes tokens per program (tile_tokens)
        self._prefix_unroll = prefix_unroll
        self.suffix_unroll = suffix_unroll or (4 if pow2(d // heads) <= 64 else 1)
        self.suffix_tokens, self.suffix_warps, self.suffix_impl = suffix_tokens, suffix_warps, suffix_impl
        self.column_tokens, self.column_warps = column_tokens, column_warps
        self.prefix_impl, self.prefix_tokens, self.prefix_warps = prefix_impl, prefix_tokens, prefix_warps
        if 0 < logits_tokens < 16:
            raise ValueError(f"logits_tokens ({logits_tokens}) must be >= 16: the logits are a tensor-core product")
        self.logits_tokens = logits_tokens or DOT_TOKENS
        if 0 < keypath_tokens < 16:
            raise ValueError(f"keypath_tokens ({keypath_tokens}) must be >= 16: the key path is a tensor-core "
                             "product over tokens")
        self.keypath_tokens, self.keypath_warps = keypath_tokens or DOT_TOKENS, keypath_warps or 4
        for name, value in (("keypath_width", keypath_width), ("column_sites", column_sites)):
            if value < 0 or value & (value - 1) or 0 < value < (16 if name == "keypath_width" else 1):
                raise ValueError(f"{name} ({value}) must be 0 (automatic) or a power of two"
                                 + (" >= 16 (a tensor-core product's column slice)" if name == "keypath_width" else ""))
        self.column_sites = column_sites or COLUMN_SITE_BLOCK
        if prefix_stages < 0:
            raise ValueError(f"prefix_stages ({prefix_stages}) must be 0 (by row width) or a number of loop stages >= 1")
        self._prefix_stages = prefix_stages
        self.dtype, self.device = embedding_BTD.dtype, embedding_BTD.device
        self.acc_t, self.acc_tl = accumulator(self.dtype)
        self.p, self.k = b * t, d // heads
        self.h_p, self.k_p = pow2(heads), pow2(self.k)
        self.k_b = 32 if self.k >= 32 else 16  # column slice of the tensor-core products
        if keypath_width > dot_dim(self.k):
            raise ValueError(f"keypath_width ({keypath_width}) is wider than the padded head ({dot_dim(self.k)} "
                             f"columns for head width {self.k})")
        self.keypath_k_b = keypath_width or self.k_b
        self.k_split = dot_split(self.k)  # the "dot" passes' head columns: two power-of-two slices
        self.k_w = column_block(self.k, column_width)  # the forward passes' columns per program
        self.k_blocks = triton.cdiv(self.k, self.k_w)
        self.prec = "ieee" if self.acc_t == torch.float64 else "tf32x3"  # fp32-accurate tensor-core dots
        self.param_dtypes = (query_SD.dtype, norm_weight_SD.dtype)
        # Launch key (mhar_lit.kernels.launch): the runtime arguments that are fixed for this object (sizes,
        # dtypes; chunk, group, tile and warps reach the kernels only as constexprs or num_warps, which the
        # launch adds). Per launch only the alignment of tensors from outside changes (every varying int is a
        # do_not_specialize argument).
        self._key = (self.shape, n, heads, eps, self.dtype)
        with torch.no_grad():
            self.q_SD = query_SD.detach().to(self.acc_t).clone()
            self.g_SD = norm_weight_SD.detach().to(self.acc_t).clone()
            self.w_SD = (self.q_SD * self.g_SD).contiguous()
            # w as the tensor-core operands of the logits and key-path kernels, split once here rather than in
            # every program: with bf16 storage two bf16 terms hi + lo (|w - hi - lo| <= 2^-17 |w|), otherwise w
            # itself twice. With row_w_tile the row column kernel loads them too (its key path; the logits
            # come from the forward's z).
            self.w_terms = split_w(self.w_SD, self.dtype)[1]
        self.rows = torch.empty(n, self.p, d, dtype=self.dtype, device=self.device)
        self.r = torch.empty(n, self.p, dtype=self.acc_t, device=self.device)
        self.lse = torch.empty(n, self.p, heads, dtype=self.acc_t, device=self.device)
        # Every (source, site) logit of the forward, for the backward (source-major triangle, see
        # _routing_kernels._pair_row): N(N+1)/2 x H x P fp32, d/H / 2 times smaller than one pass of rows.
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
        if site == 0 and (query_SD is None or norm_weight_SD is None):
            raise ValueError("site 0 must receive the full query and norm_weight parameters")
        return _FullSiteFunction.apply(self, site, source_BTD, query_SD, norm_weight_SD)

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
        block_t = self.merge_tokens or tile_tokens(c_p * self.k_w, self.tile)  # the rows' [tokens, C_P, K_W] tile
        launch(kern._merge_fwd_kernel, (triton.cdiv(self.p, block_t), self.heads, self.k_blocks),
            self.rows, self.z, m, l, acc, out_PD, self.lse,
            s0, site, site - s0, self.n_sites, self.p, d, self.heads, self.k,
            HAS_INIT=s0 > 0, BLOCK_T=block_t, K_W=self.k_w, C_P=c_p, ACC=self.acc_tl, num_warps=self.num_warps,
            key=self._key,
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
        block_t = tile_tokens(d_p, self.tile)
        source = source_BTD.contiguous()
        launch(kern._append_kernel, (triton.cdiv(p, block_t),),
            source, self.rows, self.r, site, p, d, self.eps,
            BLOCK_T=block_t, D_P=d_p, ACC=self.acc_tl, num_warps=self.num_warps,
            key=(self._key, aligned(source)),
        )
        launch(kern._logits_kernel, (triton.cdiv(p, self.logits_tokens), self.heads),
            self.rows, self.r, *self.w_terms, self.z, site, n, p, d, self.heads, self.k,
            BLOCK_T=self.logits_tokens, K_B=self.k_b, S_P=dot_dim(n - site), ACC=self.acc_tl, PREC=self.prec,
            num_warps=4, key=self._key,
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
        if self.prefix_impl == "dot":
            c_p = dot_dim(self.chunk)
            # about 4096 elements of the [tokens, sites, K] accumulator per program, at least 2 tokens
            block_t = self.prefix_tokens or max(2, 4096 // (c_p * sum(self.k_split)))
            launch(kern._prefix_dot_fwd_kernel, (triton.cdiv(self.p, block_t), self.heads),
                self.rows, self.z, m, l, acc,
                s0, s0, c, self.n_sites, self.p, self.shape[2], self.heads, self.k,
                C_P=c_p, BLOCK_T=block_t, K_A=self.k_split[0], K_B=self.k_split[1], R_B=PREFIX_ROW_BLOCK,
                ACC=self.acc_tl, PREC=self.prec,
                num_warps=self.prefix_warps or 4, key=self._key,
            )
            return
        c_p = pow2(self.chunk)
        block_t = self.prefix_tokens or tile_tokens(c_p * self.k_w, self.tile)
        launch(kern._prefix_fwd_kernel, (triton.cdiv(self.p, block_t), self.heads, self.k_blocks),
            self.rows, self.z, m, l, acc,
            s0, s0, c, self.n_sites, self.p, self.shape[2], self.heads, self.k,
            C_P=c_p, BLOCK_T=block_t, K_W=self.k_w, ACC=self.acc_tl, UNROLL=self.prefix_unroll(),
            R_B=max(1, min(PREFIX_ROW_BLOCK, pow2_floor(self.tile // (c_p * block_t)))), STAGES=self.prefix_stages(),
            ROW_3D=self.prefix_row_3d, num_warps=self.prefix_warps or self.num_warps, key=self._key,
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
            if self.group < n and self.suffix_keys() else None,
        }

    def suffix_keys(self) -> bool:
        """Whether the suffix pass also does its pairs' key path and coupling (into part_dv and part_c): for
        the full-row column kernel, with the tensor-core suffix (a third product per token there), so that the
        row kernel reads no suffix pair. The fma suffix leaves the key path to the row kernel's loop."""
        return self.column_impl == "row" and self.suffix_impl == "dot"

    def _suffix(self, g0: int, g_end: int) -> None:
        """Value path and dl of all sites >= g_end against the sources [g0, g_end), one read of each."""
        bw, d = self._bwd, self.shape[2]
        args = (self.rows, self.lse, bw["S"], bw["dout_ptrs"], self.z, bw["dl"], bw["part_dv"],
                g0, g_end - g0, g_end, self.n_sites, self.n_sites, self.p, d, self.heads, self.k)
        grid = lambda block_t: (triton.cdiv(self.p, block_t), self.heads)  # noqa: E731
        if self.suffix_impl == "dot":
            keys = self.suffix_keys()
            key_args = (self.r, *self.w_terms, bw["part_c"]) if keys else (self.r, self.r, self.r, self.r)
            g_p = dot_dim(self.group)
            # 4 tokens: the best CUDA-graph time at 350M and 1B on the H200 (2026-12-03, call 2; at 100M the
            # rule of 4096 tile elements gave 4 as well), and the pair-table accesses, contiguous over tokens,
            # are 16-byte rather than 4-byte gathers
            block_t = self.suffix_tokens or 4
            launch(kern._suffix_dot_bwd_kernel, grid(block_t), *args, *key_args,
                G_P=g_p, BLOCK_T=block_t, K_A=self.k_split[0], K_B=self.k_split[1], S_B=SUFFIX_SITE_BLOCK,
                ACC=self.acc_tl, PREC=self.prec, KEYPATH=keys,
                num_warps=self.suffix_warps or 4, key=self._key,
            )
            return
        g_p = pow2(self.group)
        # Tokens and warps from the H200 measurement of 2026-12-02 (benchmarks/results/routing_v2_*): at least
        # 2 tokens per program, 4 warps once the tile passes 2048 elements (1B: 2 tokens x 8 x 256 on 4 warps
        # ran 6.6 ms against 14.8 ms for 1 token on 2 warps; 100M/350M were best at 4/2 tokens on 2 warps).
        block_t = self.suffix_tokens or max(2, tile_tokens(g_p * self.k_p, self.tile))
        warps = self.suffix_warps or (2 if g_p * self.k_p * block_t <= 2048 else 4)
        launch(kern._suffix_bwd_kernel, grid(block_t), *args,
            G_P=g_p, BLOCK_T=block_t, K_P=self.k_p, ACC=self.acc_tl, UNROLL=self.suffix_unroll, num_warps=warps,
            key=self._key,
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
        # the in-group sites' [tokens, J_B, K] tile takes J_B times the registers of a row's
        j_b = min(self.column_sites, pow2(self.group))
        block_t = self.column_tokens or tile_tokens(j_b * self.k_p, self.tile)
        launch(kern._column_bwd_kernel, (triton.cdiv(p, block_t), self.heads),
            self.rows, self.lse, bw["S"], bw["dout_ptrs"], dout, out_BTD,
            self.z, bw["dl"], self._part_dv(g_end), bw["dvp"], bw["c"],
            site, g_end, site - g0, n, p, d, self.heads, self.k, dout.data_ptr(),
            HAS_SUFFIX=g_end < n, BLOCK_T=block_t, K_P=self.k_p, S_P=dot_dim(n - g_end), J_B=j_b, ACC=self.acc_tl,
            num_warps=self.column_warps or self.num_warps, key=(self._key, aligned(dout), aligned(out_BTD)),
        )
        dsrc_PD = torch.empty(p, d, dtype=self.dtype, device=self.device)
        launch(kern._keypath_kernel, (triton.cdiv(p, self.keypath_tokens), self.heads),
            self.rows, self.r, *self.w_terms, bw["dl"], bw["dvp"], bw["c"], dsrc_PD, site, n, p, d, self.heads,
            self.k,
            BLOCK_T=self.keypath_tokens, K_B=self.keypath_k_b, S_P=dot_dim(n - site), H_P=self.h_p, ACC=self.acc_tl,
            PREC=self.prec, num_warps=self.keypath_warps, key=self._key,
        )
        return dsrc_PD

    def prefix_stages(self) -> int:
        """Loop stages of the fma prefix (see PIPELINED_PREFIX_STAGES): as configured, else pipelined where a
        program's row slice is at least PIPELINE_MIN_BYTES contiguous bytes."""
        wide = self.k_w * self.dtype.itemsize >= PIPELINE_MIN_BYTES
        return self._prefix_stages or (PIPELINED_PREFIX_STAGES if wide else 1)

    def prefix_unroll(self) -> int:
        """Rows per step of the fma prefix: as configured, else by whether its loop is pipelined."""
        pipelined = self.prefix_stages() > 1
        return self._prefix_unroll or (PIPELINED_PREFIX_UNROLL if pipelined else UNPIPELINED_PREFIX_UNROLL)

    def _part_dv(self, g_end: int) -> Tensor:
        """The suffix pass's partials for a column kernel; without a suffix (g_end == n) the kernel reads none,
        and any tensor stands in for the pointer (there is no part_dv buffer when one group holds every site)."""
        return self._bwd["part_dv"] if g_end < self.n_sites else self._bwd["S"]

    def _part_c(self, g_end: int) -> Tensor:
        """The suffix pass's coupling partials for the row kernel (S stands in where it reads none: no suffix
        pass, or one that leaves the key path to the row kernel, and then there is no part_c buffer)."""
        part_c = self._bwd["part_c"]
        return part_c if g_end < self.n_sites and part_c is not None else self._bwd["S"]

    def _column_rows(self, site: int, g0: int, g_end: int, out_BTD: Tensor, dout: Tensor) -> Tensor:
        """_column with full-row programs (column_impl "row"): one kernel, no fp32 round trip."""
        bw, p, d, n = self._bwd, self.p, self.shape[2], self.n_sites
        dsrc_PD = torch.empty(p, d, dtype=self.dtype, device=self.device)
        block_t = self.column_tokens or tile_tokens(self.h_p * self.k_p, ROW_COLUMN_TILE)
        launch(kern._column_row_bwd_kernel, (triton.cdiv(p, block_t),),
            self.rows, self.r, *(self.w_terms if self.row_w_tile else (self.w_SD, self.w_SD)), self.lse, bw["S"],
            bw["dout_ptrs"], dout, out_BTD,
            self.z, bw["dl"], self._part_dv(g_end), self._part_c(g_end), dsrc_PD,
            site, g_end, site - g0, n, p, d, self.heads, self.k, dout.data_ptr(),
            HAS_SUFFIX=g_end < n, SUFFIX_KEYS=self.suffix_keys(), BLOCK_T=block_t, H_P=self.h_p, K_P=self.k_p,
            ACC=self.acc_tl, W_TILE=self.row_w_tile,
            SPLIT_W=self.row_w_tile and self.w_terms[0] is not self.w_terms[1],
            G_P=pow2(self.group) if self.row_dl_buffer and pow2(self.group) <= ROW_DL_BUFFER_MAX else 0,
            num_warps=self.column_warps or ROW_COLUMN_WARPS, key=(self._key, aligned(dout), aligned(out_BTD)),
        )
        return dsrc_PD

    def _query_grad(self) -> Tensor:
        """A [N, D] from every pair's dl and kr (one launch once all dl exist); dq = A g, dg = A q."""
        bw, p, d, n = self._bwd, self.p, self.shape[2], self.n_sites
        blocks = triton.cdiv(p, DOT_TOKENS)
        a_part = torch.empty(blocks, n, d, dtype=self.acc_t, device=self.device)
        launch(kern._query_grad_kernel, (blocks, self.heads, triton.cdiv(self.k, self.k_b)),
            self.rows, self.r, bw["dl"], a_part, n, p, d, self.heads, self.k,
            BLOCK_T=DOT_TOKENS, K_B=self.k_b, S_P=dot_dim(n), ACC=self.acc_tl, PREC=self.prec, num_warps=4,
            key=self._key,
        )
        return a_part.sum(0)


def default_column_impl(k: int, heads: int, group_all: bool, suffix_impl: str) -> str:
    """"row" where it was measured to win (COLUMN_IMPLS): power-of-two heads <= ROW_MAX_HEAD wide whose full row
    fits the row tile (wider rows would leave one token per program with more than 8 elements per thread, where
    it spills), when the suffix pass brings its pairs' key path ("dot") or there is no suffix pass (group_all:
    one group of all sites); else "head"."""
    fits = pow2(heads) * k <= ROW_COLUMN_TILE
    return "row" if pow2(k) == k <= ROW_MAX_HEAD and fits and (suffix_impl == "dot" or group_all) else "head"


def balanced_group(n: int, most: int) -> int:
    """Group length for n sites in as few groups of at most `most` as possible, the lengths as even as they
    can be (the last group is never much shorter than the others): 49, 16 -> 13; 73, 16 -> 15; 16, 16 -> 16."""
    groups = max(1, -(-n // most))
    return max(1, -(-n // groups))


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (1 for n < 2)."""
    return 1 << max(0, n.bit_length() - 1)


def aligned(x: Tensor) -> bool:
    """Whether Triton sees this tensor's pointer as 16-byte aligned (it specialises on that)."""
    return x.data_ptr() % 16 == 0


def column_block(k: int, width: int = 0) -> int:
    """Head columns per program of the forward prefix and merge passes: `width` (a power of two dividing k)
    or, with 0, the whole head when k is a power of two, else the largest power of two >= 16 dividing k
    (1B's 160 = 5 x 32: no padded columns, where one power-of-two tile would pad it to 256), else the
    padded head (one block). H200, 2026-12-03: the 1B merge pass 1.00 -> 0.58 ms, the prefix 2.61 -> 2.34 ms
    (with unroll 2). The column kernel reduces over the head, so it cannot split it over programs; a version
    with two power-of-two slices (128 + 32) in one program ran 5.3 ms against 2.2 ms padded (not kept)."""
    if width:
        if width & (width - 1) or k % width:
            raise ValueError(f"column_width {width} must be a power of two dividing the head width {k}")
        return width
    if pow2(k) == k:
        return k
    div = k & -k  # largest power of two dividing k
    return div if div >= 16 else pow2(k)


def dot_split(k: int) -> tuple[int, int]:
    """Head width k as two power-of-two slices (a, b), each >= 16 (b = 0: one slice), when that is narrower
    than one padded slice: 160 -> (128, 32), 96 -> (64, 32); 64 -> (64, 0); 20 -> (32, 0)."""
    whole = dot_dim(k)
    a = max(16, whole // 2)
    if k <= a:
        return whole, 0
    b = dot_dim(k - a)
    return (a, b) if a + b < whole else (whole, 0)


def dot_dim(n: int) -> int:
    """A tensor-core product's dimension: a power of two >= 16."""
    return max(16, pow2(n))


class _FullSiteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, routing: FullRouting, site: int, source_BTD: Tensor, query_SD: Optional[Tensor],
                norm_weight_SD: Optional[Tensor]) -> Tensor:
        ctx.routing, ctx.site = routing, site
        out_BTD = routing.forward_site(site, source_BTD)
        # Saved through autograd, not kept on `routing`: freed as the backward passes (or kept for a rerun
        # with retain_graph). The final site also saves the shared state (rows, statistics, logits).
        final = site == routing.n_sites - 1
        ctx.save_for_backward(out_BTD, *(routing.saved_state() if final else ()))
        return out_BTD

    @staticmethod
    @once_differentiable
    def backward(ctx, dout_BTD: Tensor):
        out_BTD, *state = ctx.saved_tensors
        if state:
            ctx.routing.restore(*state)
        dsrc, dq, dg = ctx.routing.backward_site(ctx.site, out_BTD, dout_BTD)
        return None, None, dsrc, dq, dg
