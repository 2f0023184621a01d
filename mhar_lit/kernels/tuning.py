"""Tuning of the routing kernels: one config object per mode, and the measured per-shape defaults.

A field left at 0 (or "") takes the default for the shape (`resolved`); every default below was the fastest
measured on an H200 (benchmarks/results/routing.md for full mode, block_routing.md for block mode). The
configs change speed only: every setting computes the same routing to fp32 rounding order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from mhar_lit.kernels.host import dot_dim, pow2, pow2_floor, tile_tokens

# ---------------------------------------------------------------- full mode (FullRouting)
DEFAULT_CHUNK = 4  # sites per forward prefix pass: the 350M best, within 1.35x of the best elsewhere (2026-12-02)
DEFAULT_GROUP = 16  # most sources per backward suffix pass, spread evenly (balanced_group; 2026-12-04)
DEFAULT_WARPS = 2
DEFAULT_TILE = 2048  # elements of one register tile (fixes tokens per program)
DOT_TOKENS = 64  # tokens per program of the tensor-core kernels (logits, key path, dq/dg)
# tokens per program of the dl projection before dq/dg (one row of a pair table per load; not tuned on a GPU)
PROJECT_TOKENS = 256  # with 2 warps: 16-byte loads
UNROLL_CHOICES = (1, 2, 4)
# Prefix rows per step: 2 where its loop is pipelined (the async copies keep loads in flight), 4 elsewhere;
# pipelined (3 stages) from 256 contiguous bytes per row slice (350M faster; 100M, 1B slower; 2026-12-04).
UNPIPELINED_PREFIX_UNROLL, PIPELINED_PREFIX_UNROLL = 4, 2
PIPELINED_PREFIX_STAGES = 3
PIPELINE_MIN_BYTES = 256
PREFIX_ROW_BLOCK = 16  # rows per step of the prefix's max loop at most (a [C_P, tokens, rows] tile of logits)
SUFFIX_SITE_BLOCK = 16  # later sites per step of the tensor-core suffix pass
SUFFIX_TOKENS, SUFFIX_WARPS = 4, 4  # the suffix pass's best CUDA-graph time at 350M and 1B (2026-12-03)
# The suffix pass's shared memory grows with its [tokens, K] row tile: per byte of that tile, 48 bytes in fp32 and
# 33-34 in bf16 (benchmarks/compile_check.py for sm_90, 2026-12-07: 139,648 B at 4 tokens x 512 bf16, 270,720 at
# 4 x 1024, 336,384 at 4 x 1280, 135,424 at 2 x 1024, 168,320 at 2 x 1280; 393,728 at 4 x 512 fp32). 4 tokens
# of a 1024- or 1280-wide bf16 head (one routing head at 350M or 1B) pass the H100's 227 KB and do not launch;
# wide heads get fewer tokens, within SUFFIX_SMEM_BUDGET.
SUFFIX_SMEM_PER_TILE_BYTE = {4: 48, 2: 34}
SUFFIX_SMEM_BUDGET = 200 * 1024
COLUMN_SITE_BLOCK = 2  # in-group sites per step of the per-head column kernel: beat 1 and 4 everywhere (2026-12-04)
# How a source's backward is finished: "row" (one full-row kernel) wins at 100M / 350M, "head" (per-head
# column kernel + tensor-core key path) at 1B, whose head width 160 pads to 256 (2026-12-04; default_column_impl).
COLUMN_IMPLS = ("row", "head")
ROW_MAX_HEAD = 128
ROW_COLUMN_TILE, ROW_COLUMN_WARPS = 1024, 4  # the row kernel's tile: 8 elements per thread (100M: 2.52 vs 2.71 ms)
KEYPATH_WARPS = 4


@dataclass(frozen=True)
class FullRoutingConfig:
    """FullRouting's knobs; 0 / "" = the measured default for the shape (see `resolved`). column_tokens and
    column_warps apply to whichever column kernel column_impl picks; prefix_stages and prefix_unroll to the
    prefix pass's row loop. Each field is one that an H200 sweep (`benchmarks/routing.py --tune --grid`,
    benchmarks/results/routing.md) has set; the key path's column slice follows the head width (column_slice)."""

    chunk: int = DEFAULT_CHUNK
    group: int = 0
    num_warps: int = DEFAULT_WARPS
    tile_elements: int = DEFAULT_TILE
    prefix_unroll: int = 0
    prefix_stages: int = 0
    prefix_tokens: int = 0
    prefix_warps: int = 0
    suffix_tokens: int = 0
    suffix_warps: int = 0
    column_impl: str = ""
    column_tokens: int = 0
    column_warps: int = 0
    column_width: int = 0
    column_sites: int = 0
    keypath_tokens: int = 0
    keypath_warps: int = 0
    logits_tokens: int = 0

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.group < 0:
            raise ValueError(f"chunk ({self.chunk}) must be >= 1 and group ({self.group}) >= 0 (0: automatic, "
                             "balanced_group)")
        if self.prefix_unroll not in (0, *UNROLL_CHOICES):
            raise ValueError(f"prefix_unroll must be one of {(0, *UNROLL_CHOICES)} (0: by pipelining), "
                             f"got {self.prefix_unroll}")
        if self.column_impl not in ("", *COLUMN_IMPLS):
            raise ValueError(f"column_impl must be one of {COLUMN_IMPLS} (or '' for the default by head width "
                             f"and row tile), got {self.column_impl!r}")
        for name in ("suffix", "column", "prefix", "keypath", "logits"):
            tokens, warps = getattr(self, f"{name}_tokens"), getattr(self, f"{name}_warps", 0)
            if tokens < 0 or tokens & (tokens - 1) or warps < 0:
                raise ValueError(f"{name}_tokens ({tokens}) must be 0 (automatic) or a power of two, "
                                 f"{name}_warps ({warps}) 0 (automatic) or positive")
        for name in ("logits_tokens", "keypath_tokens"):
            if 0 < getattr(self, name) < 16:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 16: a tensor-core product over tokens")
        if self.column_sites < 0 or self.column_sites & (self.column_sites - 1):
            raise ValueError(f"column_sites ({self.column_sites}) must be 0 (automatic) or a power of two")
        if self.prefix_stages < 0:
            raise ValueError(f"prefix_stages ({self.prefix_stages}) must be 0 (by row width) or a number of loop "
                             "stages >= 1")

    def resolved(self, n_sites: int, width: int, heads: int, itemsize: int) -> "FullRoutingConfig":
        """Every automatic field filled in for n_sites sites, hidden width `width`, `heads` routing heads and
        rows of `itemsize` bytes per element."""
        k = width // heads
        impl = self.column_impl or default_column_impl(k, heads)
        group = min(self.group or balanced_group(n_sites, DEFAULT_GROUP), n_sites)
        chunk = min(self.chunk, n_sites)
        k_w = column_block(k, self.column_width)
        stages = self.prefix_stages or (PIPELINED_PREFIX_STAGES if k_w * itemsize >= PIPELINE_MIN_BYTES else 1)
        unroll = self.prefix_unroll or (PIPELINED_PREFIX_UNROLL if stages > 1 else UNPIPELINED_PREFIX_UNROLL)
        column_sites = self.column_sites or COLUMN_SITE_BLOCK
        if impl == "row":
            column_tokens = self.column_tokens or tile_tokens(pow2(heads) * pow2(k), ROW_COLUMN_TILE)
        else:  # the in-group sites' [tokens, J_B, K] tile takes J_B times the registers of a row's
            column_tokens = self.column_tokens or tile_tokens(min(column_sites, pow2(group)) * pow2(k),
                                                              self.tile_elements)
        prefix_tokens = self.prefix_tokens or tile_tokens(pow2(chunk) * k_w, self.tile_elements)
        return dataclasses.replace(
            self, chunk=chunk, group=group, column_impl=impl, column_width=k_w, prefix_stages=stages,
            prefix_unroll=unroll, prefix_tokens=prefix_tokens, prefix_warps=self.prefix_warps or self.num_warps,
            suffix_tokens=self.suffix_tokens or suffix_tokens_for(k, itemsize),
            suffix_warps=self.suffix_warps or SUFFIX_WARPS,
            column_tokens=column_tokens,
            column_warps=self.column_warps or (ROW_COLUMN_WARPS if impl == "row" else self.num_warps),
            column_sites=column_sites, keypath_tokens=self.keypath_tokens or DOT_TOKENS,
            keypath_warps=self.keypath_warps or KEYPATH_WARPS,
            logits_tokens=self.logits_tokens or DOT_TOKENS,
        )

    def prefix_row_block(self) -> int:
        """Rows per step of the (resolved) prefix's max loop: at most PREFIX_ROW_BLOCK, fewer when the token
        tile is large."""
        return max(1, min(PREFIX_ROW_BLOCK, pow2_floor(self.tile_elements // (pow2(self.chunk) * self.prefix_tokens))))


def default_column_impl(k: int, heads: int) -> str:
    """"row" where it was measured to win: power-of-two heads <= ROW_MAX_HEAD wide whose full row fits the row
    tile (wider rows leave one token per program with more than 8 elements per thread, where it spills); else
    "head"."""
    fits = pow2(heads) * k <= ROW_COLUMN_TILE
    return "row" if pow2(k) == k <= ROW_MAX_HEAD and fits else "head"


def suffix_smem_bytes(tokens: int, k: int, itemsize: int) -> int:
    """The suffix pass's estimated shared memory for a [tokens, k] row tile of `itemsize`-byte elements."""
    return tokens * k * itemsize * SUFFIX_SMEM_PER_TILE_BYTE.get(itemsize, max(SUFFIX_SMEM_PER_TILE_BYTE.values()))


def suffix_tokens_for(k: int, itemsize: int) -> int:
    """SUFFIX_TOKENS, halved while the suffix pass's shared memory would pass SUFFIX_SMEM_BUDGET (at least 1)."""
    tokens = SUFFIX_TOKENS
    while tokens > 1 and suffix_smem_bytes(tokens, k, itemsize) > SUFFIX_SMEM_BUDGET:
        tokens //= 2
    return tokens


def balanced_group(n: int, most: int) -> int:
    """Group length for n sites in as few groups of at most `most` as possible, the lengths as even as they
    can be (the last group is never much shorter than the others): 49, 16 -> 13; 73, 16 -> 15; 16, 16 -> 16."""
    groups = max(1, -(-n // most))
    return max(1, -(-n // groups))


def column_slice(k: int) -> int:
    """Column slice of the tensor-core products over a head of width k."""
    return 32 if k >= 32 else 16


def column_block(k: int, width: int = 0) -> int:
    """Head columns per program of the forward prefix and merge passes: `width` (a power of two dividing k)
    or, with 0, the whole head when k is a power of two, else the largest power of two >= 16 dividing k
    (1B's 160 = 5 x 32: no padded columns; merge 1.00 -> 0.58 ms, prefix 2.61 -> 2.34 ms), else the padded
    head (one block)."""
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


# ---------------------------------------------------------------- block mode (BlockRouting)
BLOCK_TILE = 4096  # 4096-element tiles beat 2048 at every shape (2026-12-05)
PIPELINED_FORWARD_MIN_TOKENS = 4  # the forward's block-row loop pipelined from 4 tokens per program (2026-12-05)
PIPELINE_STAGES = 3
BLOCK_PASS_WARPS = 8  # the block pass: 8 warps beat 4 at every shape, unpipelined (2026-12-05)
QUERY_GRAD_TOKENS = DOT_TOKENS


@dataclass(frozen=True)
class BlockRoutingConfig:
    """BlockRouting's knobs; 0 = the measured default. stages: software-pipelining stages of all three loops
    (0: the forward's and the dq/dg pass's pipelined, the block pass's not; 1: none)."""

    num_warps: int = 0  # 0: 8 where a tile holds one token, else 4
    tile_elements: int = BLOCK_TILE
    pass_warps: int = 0
    pass_tile_elements: int = 0  # 0: tile_elements
    stages: int = 0

    def __post_init__(self) -> None:
        if self.stages < 0:
            raise ValueError(f"stages must be >= 0 (0: automatic, 1: loops not software-pipelined), "
                             f"got {self.stages}")
        if self.num_warps < 0 or self.tile_elements < 1 or self.pass_warps < 0 or self.pass_tile_elements < 0:
            raise ValueError(f"num_warps ({self.num_warps}) and pass_warps ({self.pass_warps}) must be >= 0 "
                             f"(0: automatic), tile_elements ({self.tile_elements}) positive and "
                             f"pass_tile_elements ({self.pass_tile_elements}) >= 0 (0: tile_elements)")


def make_config(cls: type, config: Optional[Any]) -> Any:
    """A config object of `cls` from None (defaults), an instance, or a mapping of its fields."""
    if config is None:
        return cls()
    if isinstance(config, cls):
        return config
    if isinstance(config, Mapping):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - names)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}; expected some of {sorted(names)}")
        return cls(**config)
    raise TypeError(f"kernel config must be a {cls.__name__}, a mapping of its fields or None, "
                    f"got {type(config).__name__}")
