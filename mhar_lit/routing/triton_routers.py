"""The triton routers: full mode over FullRouting, block mode over BlockRouting (one shared buffer per forward
pass, mhar_lit.kernels), and the per-call custom op for delta mode. Importing this module needs triton."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

from mhar_lit.kernels.block_routing import BlockRouting
from mhar_lit.kernels.full_routing import FullRouting
from mhar_lit.kernels.routing_triton import route_triton_list
from mhar_lit.kernels.tuning import BlockRoutingConfig, FullRoutingConfig, make_config
from mhar_lit.routing import routers


class CallRouter(routers.CallRouter):
    backend = "triton"

    def route(self, sources: list[Tensor], query: Tensor, norm_weight: Tensor) -> Tensor:
        # the list entry: the stack is rebuilt in the backward, not saved
        return route_triton_list(sources, query, norm_weight, self.heads, self.eps)


@dataclass(eq=False)
class _PassState:
    """The routing object of this forward pass (one shared row buffer) and the tensor the next site brings. A
    dataclass and a pytree node, so that module-output hooks such as FSDP's find its tensor."""

    routing: Any
    pending: Optional[Tensor]
    query: Tensor
    norm: Tensor
    count: int = 1  # sources produced so far


routers.register_state_pytree(_PassState, ("pending",), ("routing", "query", "norm", "count"))


class _SharedBufferRouter(routers.DepthRouter):
    backend = "triton"

    @abstractmethod
    def _routing(self, embedding: Tensor, query_SD: Tensor, norm_SD: Tensor) -> Any: ...

    def begin(self, embedding: Tensor, query_SD: Tensor, norm_SD: Tensor) -> _PassState:
        return _PassState(self._routing(embedding, query_SD, norm_SD), embedding, query_SD, norm_SD)

    def route(self, state: _PassState, site: int) -> Tensor:
        if state.count != site + 1 or state.pending is None:
            raise RuntimeError(f"site {site} expected {site + 1} sources, found {state.count}")
        params = (state.query, state.norm) if site == 0 else (None, None)  # autograd delivers dq, dg at site 0
        mixed = state.routing.route(site, self._incoming(state), *params)
        state.pending = None
        return mixed

    def _incoming(self, state: _PassState) -> Tensor:
        return state.pending

    def add(self, state: _PassState, output: Tensor) -> _PassState:
        state.pending, state.count = output, state.count + 1
        return state


class FullRouter(_SharedBufferRouter):
    def __init__(self, heads: int, eps: float, kernel_config: Optional[Any] = None) -> None:
        super().__init__(heads, eps)
        self.kernel_config = make_config(FullRoutingConfig, kernel_config)

    def _routing(self, embedding: Tensor, query_SD: Tensor, norm_SD: Tensor) -> FullRouting:
        return FullRouting(embedding, query_SD, norm_SD, self.heads, self.eps, self.kernel_config)

    def _incoming(self, state: _PassState) -> Tensor:
        # Under autocast (bf16-mixed) the embedding is fp32 and sublayer outputs are bf16: the shared buffer
        # keeps the embedding's dtype and later sources are cast into it (exact for bf16 -> fp32).
        return state.pending.to(state.routing.dtype)

    def sources(self, state: _PassState, site: int) -> Tensor:
        return state.routing.sources_view(site + 1)


class BlockRouter(_SharedBufferRouter):
    def __init__(self, heads: int, eps: float, span: int, kernel_config: Optional[Any] = None) -> None:
        super().__init__(heads, eps)
        self.span, self.kernel_config = span, make_config(BlockRoutingConfig, kernel_config)

    def _routing(self, embedding: Tensor, query_SD: Tensor, norm_SD: Tensor) -> BlockRouting:
        return BlockRouting(embedding, query_SD, norm_SD, self.heads, self.span, self.eps, self.kernel_config)

    def sources(self, state: _PassState, site: int) -> Tensor:
        return state.routing.sources_view(site)
