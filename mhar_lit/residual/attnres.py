"""Attention residuals over depth: single-head (Kimi, arXiv 2603.15031) and multi-head MHAR (Luo, Cai, Hu 2026).

Full mode (SPEC B, C). No additive stream: every sublayer reads a learned softmax mixture of the embedding
and all earlier raw sublayer outputs, per head slice:

    S_0 = embedding                       sources: S_0, S_1 = y_0, S_2 = y_1, ...
    x_s = route(S_0..S_s; q_s, g_s, H)    site s = 0 .. 2L-1 sees s+1 sources
    y_s = sublayer_s(norm(x_s));  S_{s+1} = y_s
    final: route(S_0..S_2L; q_2L, g_2L)   a (2L+1)-th site before the final norm

Block mode (SPEC D, Kimi's Block AttnRes). Blocks of `layers_per_block` layers; inside a block the
outputs are summed into a partial p, across blocks the sublayers route over completed block sums:

    sources at a site = [embedding, B_1, ..., B_{n-1}] + ([p] if the block has produced anything)
    y = sublayer(norm(x));  p <- p + y;  at a block boundary B_n <- p, p <- nothing

Every site s has a query q_s (zero-initialised: uniform mixing at init) and a key-norm weight g_s (ones),
both of width d, so the method adds (2L+1) * 2d parameters whatever the number of heads H.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from mhar_lit.config import ModelConfig
from mhar_lit.residual.base import ResidualStrategy, is_attention_site, layer_of, register_state_pytree
from mhar_lit.routing import BACKENDS, block_mix, check_heads, merge_partial, route, routing_weights


class RoutedResidual(ResidualStrategy):
    """Shared machinery: per-site (query, key_norm) parameters and one routing call."""

    def __init__(self, heads: int = 8, backend: str = "torch", random_query_init: bool = False,
                 eps: float = 1e-6) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"unknown routing backend {backend!r}; expected one of {BACKENDS}")
        if heads < 1:
            raise ValueError(f"heads must be >= 1, got {heads}")
        self.heads = heads
        self.backend = backend
        self.random_query_init = random_query_init
        self.eps = eps
        self.record_weights = False
        self.recorded: dict[int, Tensor] = {}

    def num_routing_sites(self, config: ModelConfig) -> int:
        return 2 * config.num_layers + 1

    def build(self, config: ModelConfig) -> None:
        check_heads(config.hidden_size, self.heads)
        sites, width = self.num_routing_sites(config), config.hidden_size
        self.query = nn.Parameter(torch.empty(sites, width))
        self.key_norm = nn.Parameter(torch.empty(sites, width))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.random_query_init:  # the legacy [P1] init, kept for ablations
                nn.init.normal_(self.query, std=self.model_config.init_std)
            else:
                self.query.zero_()
            self.key_norm.fill_(1.0)

    def no_decay_parameter_names(self) -> set[str]:
        return {"key_norm"}

    def route_sources(self, sources: list[Tensor], site: int) -> Tensor:
        if self.backend == "triton":  # the stack is rebuilt in the backward, not saved (route_triton_list)
            from mhar_lit.kernels.routing_triton import route_triton_list

            if self.record_weights:
                self.record(torch.stack(sources), site)
            return route_triton_list(sources, self.query[site], self.key_norm[site], self.heads, self.eps)
        stacked = torch.stack(sources) if len(sources) > 1 else sources[0].unsqueeze(0)
        if self.record_weights:
            self.record(stacked, site)
        return route(stacked, self.query[site], self.key_norm[site], self.heads, self.eps, self.backend)

    @torch.no_grad()
    def record(self, sources_NBTD: Tensor, site: int) -> None:
        """Store the token-averaged routing weights [N, H] of `site` (for monitors and the probe)."""
        weights = routing_weights(sources_NBTD, self.query[site], self.key_norm[site], self.heads, self.eps)
        self.recorded[site] = weights.mean(dim=(1, 2)).float().cpu()

    @property
    def final_site(self) -> int:
        return 2 * self.model_config.num_layers


@dataclass(eq=False)
class _TritonState:
    """Depth state on the triton backend (FullAttnRes, BlockAttnRes): the routing object of this forward pass
    (one shared row buffer: mhar_lit.kernels.full_routing / block_routing) and the tensor the next site brings. A dataclass
    (and a pytree node) so that module-output hooks such as FSDP's find its tensor."""

    routing: Any
    pending: Optional[Tensor]
    count: int = 1  # sources produced so far


register_state_pytree(_TritonState, ("pending",), ("routing", "count"))


class FullAttnRes(RoutedResidual):
    """Full attention residuals over the embedding and every raw sublayer output. heads=1: single-head.

    backend="triton" routes through mhar_lit.kernels.full_routing.FullRouting (chunked cross-site reuse):
    `triton_chunk` sites share one forward prefix pass, `triton_group` sources one backward suffix pass (None:
    FullRouting's measured defaults: DEFAULT_CHUNK and balanced groups of at most DEFAULT_GROUP).
    That path needs every site exactly once per forward pass and the backward in reverse order; activation
    checkpointing that recomputes routing raises a RuntimeError (checkpointing sublayers is fine).
    `triton_options` are further FullRouting keywords (kernel versions and tiles, e.g. suffix_impl="fma").
    """

    def __init__(self, heads: int = 8, backend: str = "torch", random_query_init: bool = False,
                 eps: float = 1e-6, triton_chunk: Optional[int] = None, triton_group: Optional[int] = None,
                 triton_options: Optional[dict] = None) -> None:
        super().__init__(heads=heads, backend=backend, random_query_init=random_query_init, eps=eps)
        self.triton_chunk = triton_chunk
        self.triton_group = triton_group
        self.triton_options = dict(triton_options or {})

    def begin(self, embedding: Tensor) -> list[Tensor]:
        if self.backend == "triton":
            return self._triton_begin(embedding)
        return [embedding]

    def sublayer_input(self, state: list[Tensor], site: int) -> Tensor:
        if isinstance(state, _TritonState):
            return self._triton_route(state, site)
        if len(state) != site + 1:
            raise RuntimeError(f"site {site} expected {site + 1} sources, found {len(state)}")
        return self.route_sources(state, site)

    def sublayer_output(self, state: list[Tensor], site: int, output: Tensor) -> list[Tensor]:
        if isinstance(state, _TritonState):
            state.pending, state.count = output, state.count + 1
            return state
        state.append(output)
        return state

    def final(self, state: list[Tensor]) -> Tensor:
        if isinstance(state, _TritonState):
            return self._triton_route(state, self.final_site)
        return self.route_sources(state, self.final_site)

    # ---- triton path (chunked full-mode routing; the torch path above is unchanged)
    def _triton_begin(self, embedding: Tensor) -> _TritonState:
        from mhar_lit.kernels.full_routing import FullRouting

        sizes = {k: v for k, v in (("chunk", self.triton_chunk), ("group", self.triton_group)) if v is not None}
        routing = FullRouting(embedding, self.query, self.key_norm, self.heads, self.eps, **sizes,
                              **self.triton_options)
        return _TritonState(routing, embedding, 1)

    def _triton_route(self, state: _TritonState, site: int) -> Tensor:
        if state.count != site + 1 or state.pending is None:
            raise RuntimeError(f"site {site} expected {site + 1} sources, found {state.count}")
        params = (self.query, self.key_norm) if site == 0 else (None, None)
        # Under autocast (bf16-mixed) the embedding is fp32 and sublayer outputs are bf16: the shared buffer
        # keeps the embedding's dtype and later sources are cast into it (exact for bf16 -> fp32).
        pending = state.pending.to(state.routing.dtype)
        mixed = state.routing.route(site, pending, *params)
        state.pending = None
        if self.record_weights:
            self.record(state.routing.sources_view(site + 1), site)
        return mixed


@dataclass(eq=False)
class _BlockState:
    """Completed block sums (the embedding first) and the running partial sum of the current block; with
    two_phase, the block's phase-1 softmax state (m, l, o of routing.block_mix) and its first site."""

    blocks: list[Tensor]
    partial: Optional[Tensor] = None
    mix: Optional[tuple[Tensor, Tensor, Tensor]] = None
    mix_site: int = 0

    def sources(self) -> list[Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])


register_state_pytree(_BlockState, ("blocks", "partial", "mix"), ("mix_site",))


class BlockAttnRes(RoutedResidual):
    """Block attention residuals: additive inside blocks of `layers_per_block` layers, routed across blocks.

    Blocks are counted in transformer layers and must tile the depth exactly (no ceil rule): a depth that
    is not a multiple of `layers_per_block` is a ValueError naming both numbers.

    backend="triton" routes through mhar_lit.kernels.block_routing.BlockRouting (one shared row buffer that
    also forms the partial sums; one launch per site and pass); the order contract of FullAttnRes applies.
    triton_shared_buffer=False keeps the per-call kernel over a stack of the sources per site (for
    comparison; it allows checkpointing that recomputes routing).

    two_phase=True (torch backend) computes the same routing as Kimi's two-phase refactoring (SPEC D): at a
    block's first site every site of the block is scored against the completed blocks at once (each block
    normalised and read once per block, not once per site), and each site then merges that softmax state with
    the block's partial sum. Equal to the direct routing up to fp32 rounding order and keeping fewer bytes for
    the backward on the PyTorch backend; faster on CPU (benchmarks/results/cpu_two_phase_2026-12-05) and on the
    H200 at 100M / 350M, slower there at 1B (block_routing.md, session 15). The triton
    backend has its own fused schedule and ignores it (with a warning).
    """

    def __init__(self, heads: int = 8, layers_per_block: int = 2, backend: str = "torch",
                 random_query_init: bool = False, eps: float = 1e-6, triton_shared_buffer: bool = True,
                 triton_options: Optional[dict] = None, two_phase: bool = False) -> None:
        super().__init__(heads=heads, backend=backend, random_query_init=random_query_init, eps=eps)
        if layers_per_block < 1:
            raise ValueError(f"layers_per_block must be >= 1, got {layers_per_block}")
        self.layers_per_block = layers_per_block
        self.two_phase = two_phase  # SPEC D's two-phase computation on the torch backend
        self.triton_shared_buffer = triton_shared_buffer  # False: the per-call kernel on stacked sources
        self.triton_options = dict(triton_options or {})  # BlockRouting keywords (tiles, warps, stages)

    def build(self, config: ModelConfig) -> None:
        if config.num_layers % self.layers_per_block != 0:
            raise ValueError(
                f"num_layers {config.num_layers} is not divisible by layers_per_block {self.layers_per_block}"
            )
        super().build(config)

    def begin(self, embedding: Tensor) -> _BlockState:
        if self.backend == "triton" and self.two_phase and not getattr(self, "_warned_two_phase", False):
            self._warned_two_phase = True
            warnings.warn("BlockAttnRes(two_phase=True) applies to the torch backend; the triton backend routes "
                          "with its fused kernels", stacklevel=2)
        if self.backend == "triton" and self.triton_shared_buffer:
            from mhar_lit.kernels.block_routing import BlockRouting

            routing = BlockRouting(embedding, self.query, self.key_norm, self.heads,
                                   span=2 * self.layers_per_block, eps=self.eps, **self.triton_options)
            return _TritonState(routing, embedding, 1)
        return _BlockState([embedding])

    def sublayer_input(self, state: _BlockState, site: int) -> Tensor:
        if isinstance(state, _TritonState):
            return self._triton_route(state, site)
        layer = layer_of(site)
        block_start = is_attention_site(site) and layer % self.layers_per_block == 0
        if block_start and layer > 0:
            state.blocks.append(state.partial)  # the previous block is complete
            state.partial = None
        if self.two_phase and self.backend == "torch":
            if block_start:
                self._score_block(state, site)
            return self._merge(state, site)
        return self.route_sources(state.sources(), site)

    def sublayer_output(self, state: _BlockState, site: int, output: Tensor) -> _BlockState:
        if isinstance(state, _TritonState):  # the kernel adds it into the block's partial sum
            state.pending, state.count = output, state.count + 1
            return state
        state.partial = output if state.partial is None else state.partial + output
        return state

    def final(self, state: _BlockState) -> Tensor:
        if isinstance(state, _TritonState):
            return self._triton_route(state, self.final_site)
        if self.two_phase and self.backend == "torch":
            return self._merge(state, self.final_site)
        return self.route_sources(state.sources(), self.final_site)

    def _score_block(self, state: _BlockState, site: int) -> None:
        """Phase 1 at a block's first site: its sites (and the final site after the last block) are contiguous."""
        count = 2 * self.layers_per_block + (site + 2 * self.layers_per_block == self.final_site)
        sites = slice(site, site + count)
        # torch.stack promotes mixed dtypes (fp32 embedding, bf16 sublayer outputs under autocast) as the direct
        # routing's stack does, so keys are rounded to the same dtype on both paths
        state.mix = block_mix(torch.stack(state.blocks), self.query[sites], self.key_norm[sites], self.heads, self.eps)
        state.mix_site = site

    def _merge(self, state: _BlockState, site: int) -> Tensor:
        """Phase 2: the site's softmax state over the completed blocks merged with the block's partial sum."""
        sources = state.sources()
        if self.record_weights:
            self.record(torch.stack(sources), site)
        m, l, o = (x[site - state.mix_site] for x in state.mix)  # noqa: E741
        dtype = functools.reduce(torch.promote_types, (x.dtype for x in sources))  # as the direct routing's stack
        if state.partial is None:
            return o.to(dtype)
        return merge_partial(m, l, o, state.partial.to(dtype), self.query[site], self.key_norm[site], self.heads,
                             self.eps).to(dtype)

    def _triton_route(self, state: _TritonState, site: int) -> Tensor:
        if state.count != site + 1 or state.pending is None:
            raise RuntimeError(f"site {site} expected {site + 1} sublayer inputs, found {state.count}")
        params = (self.query, self.key_norm) if site == 0 else (None, None)
        mixed = state.routing.route(site, state.pending, *params)
        state.pending = None
        if self.record_weights:
            self.record(state.routing.sources_view(site), site)
        return mixed
