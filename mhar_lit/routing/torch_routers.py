"""The PyTorch routers: the reference paths (eager PyTorch, autograd does the backward)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from mhar_lit.routing import routers
from mhar_lit.routing.reference import block_mix, merge_partial, route_reference


def _stack(sources: list[Tensor]) -> Tensor:
    # torch.stack promotes mixed dtypes (fp32 embedding, bf16 sublayer outputs under autocast)
    return torch.stack(sources) if len(sources) > 1 else sources[0].unsqueeze(0)


class CallRouter(routers.CallRouter):
    backend = "torch"

    def route(self, sources: list[Tensor], query: Tensor, norm_weight: Tensor) -> Tensor:
        return routers.route(_stack(sources), query, norm_weight, self.heads, self.eps)


@dataclass(eq=False)
class _FullState:
    """The sources so far (the embedding first) and the parameters of this pass."""

    sources: list[Tensor]
    query: Tensor
    norm: Tensor


routers.register_state_pytree(_FullState, ("sources",), ("query", "norm"))


class FullRouter(routers.DepthRouter):
    backend = "torch"

    def begin(self, embedding: Tensor, query_SD: Tensor, norm_SD: Tensor) -> _FullState:
        return _FullState([embedding], query_SD, norm_SD)

    def route(self, state: _FullState, site: int) -> Tensor:
        if len(state.sources) != site + 1:
            raise RuntimeError(f"site {site} expected {site + 1} sources, found {len(state.sources)}")
        return route_reference(_stack(state.sources), state.query[site], state.norm[site], self.heads, self.eps)

    def add(self, state: _FullState, output: Tensor) -> _FullState:
        state.sources.append(output)
        return state

    def sources(self, state: _FullState, site: int) -> Tensor:
        return _stack(state.sources[: site + 1])


@dataclass(eq=False)
class _BlockState:
    """Completed block sums (the embedding first), the running partial sum of the current block and the
    parameters of this pass; with two_phase, the block's phase-1 softmax state (m, l, o of block_mix) and its
    first site."""

    blocks: list[Tensor]
    query: Tensor
    norm: Tensor
    partial: Optional[Tensor] = None
    mix: Optional[tuple[Tensor, Tensor, Tensor]] = None
    mix_site: int = 0

    def sources(self) -> list[Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])


routers.register_state_pytree(_BlockState, ("blocks", "partial", "mix"), ("query", "norm", "mix_site"))


class BlockRouter(routers.DepthRouter):
    """Block mode on the reference. Inside a block the outputs are summed into a partial; across blocks sites
    route over completed block sums: sources = [embedding, B_1, ..., B_{n-1}] + ([p] if the block has produced
    anything); at a block boundary B_n <- p.

    two_phase computes the same routing as Kimi's two-phase refactoring (docs/method.md D): at a block's first
    site every site of the block is scored against the completed blocks at once (each block normalised and
    read once per block), and each site then merges that softmax state with the block's partial sum. Equal to
    the direct routing up to fp32 rounding order, and keeps fewer bytes for the backward; faster on CPU and on
    the H200 at 100M / 350M, slower at 1B (benchmarks/results/block_routing.md)."""

    backend = "torch"

    def __init__(self, heads: int, eps: float, span: int, two_phase: bool = False) -> None:
        super().__init__(heads, eps)
        self.span, self.two_phase = span, two_phase

    def begin(self, embedding: Tensor, query_SD: Tensor, norm_SD: Tensor) -> _BlockState:
        return _BlockState([embedding], query_SD, norm_SD)

    def route(self, state: _BlockState, site: int) -> Tensor:
        block_start = site % self.span == 0  # the final site too: it routes over every completed block
        if block_start and site > 0:
            state.blocks.append(state.partial)  # the previous block is complete
            state.partial = None
        if not self.two_phase:
            return route_reference(_stack(state.sources()), state.query[site], state.norm[site], self.heads,
                                   self.eps)
        if block_start:
            self._score_block(state, site)
        return self._merge(state, site)

    def add(self, state: _BlockState, output: Tensor) -> _BlockState:
        state.partial = output if state.partial is None else state.partial + output
        return state

    def sources(self, state: _BlockState, site: int) -> Tensor:
        return _stack(state.sources())

    def _score_block(self, state: _BlockState, site: int) -> None:
        """Phase 1 at a block's first site: its sites (and the final site after the last block) are contiguous."""
        last = state.query.shape[0] - 1
        count = self.span + (site + self.span == last)
        sites = slice(site, site + count)
        # torch.stack promotes mixed dtypes as the direct routing's stack does, so keys are rounded to the same
        # dtype on both paths
        state.mix = block_mix(torch.stack(state.blocks), state.query[sites], state.norm[sites], self.heads, self.eps)
        state.mix_site = site

    def _merge(self, state: _BlockState, site: int) -> Tensor:
        """Phase 2: the site's softmax state over the completed blocks merged with the block's partial sum."""
        sources = state.sources()
        m, l, o = (x[site - state.mix_site] for x in state.mix)  # noqa: E741
        dtype = functools.reduce(torch.promote_types, (x.dtype for x in sources))  # as the direct routing's stack
        if state.partial is None:
            return o.to(dtype)
        return merge_partial(m, l, o, state.partial.to(dtype), state.query[site], state.norm[site], self.heads,
                             self.eps).to(dtype)
