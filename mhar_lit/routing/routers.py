"""Router interface, factory and the public per-call `route` (contract: the package docstring)."""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from typing import Any, Mapping, Optional

from torch import Tensor

from mhar_lit.routing.reference import check_route_args, route_reference

BACKENDS = ("torch", "triton")
MODES = ("full", "block", "call")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown routing backend {backend!r}; expected one of {BACKENDS}")


class DepthRouter(ABC):
    """Routing of one full- or block-mode model over its sites; see the package docstring for the contract."""

    backend: str

    def __init__(self, heads: int, eps: float) -> None:
        self.heads, self.eps = heads, eps

    @abstractmethod
    def begin(self, embedding: Tensor, query_SD: Tensor, norm_SD: Tensor) -> Any: ...

    @abstractmethod
    def route(self, state: Any, site: int) -> Tensor: ...

    @abstractmethod
    def add(self, state: Any, output: Tensor) -> Any: ...

    @abstractmethod
    def sources(self, state: Any, site: int) -> Tensor: ...


class CallRouter(ABC):
    """One routing call over a list of sources (delta mode)."""

    backend: str

    def __init__(self, heads: int, eps: float) -> None:
        self.heads, self.eps = heads, eps

    @abstractmethod
    def route(self, sources: list[Tensor], query: Tensor, norm_weight: Tensor) -> Tensor: ...


def make_router(mode: str, backend: str, heads: int, eps: float = 1e-6, span: int = 0, two_phase: bool = False,
                kernel_config: Optional[Mapping | Any] = None):
    """The router of `mode` ("full", "block", "call") on `backend` ("torch", "triton").

    span: sites per block (2 x layers per block; block mode only). two_phase: block mode's two-phase
    computation on the torch backend (the triton block router has its own fused schedule and warns).
    kernel_config: a FullRoutingConfig / BlockRoutingConfig or a mapping of its fields (triton full and block
    routers only; the defaults are the measured ones)."""
    check_backend(backend)
    if mode not in MODES:
        raise ValueError(f"unknown routing mode {mode!r}; expected one of {MODES}")
    if mode != "block" and (span or two_phase):
        raise ValueError(f"span and two_phase are block-mode options, not {mode!r}")
    if kernel_config is not None and (backend != "triton" or mode == "call"):
        raise ValueError(f"kernel_config applies to the triton full and block routers, not {mode!r} on {backend!r}")
    if mode == "block" and span < 2:
        raise ValueError(f"block routing needs span (sites per block) >= 2, got {span}")
    if backend == "torch":
        from mhar_lit.routing import torch_routers as impl
    else:  # needs triton: imported only when chosen
        from mhar_lit.routing import triton_routers as impl
    if mode == "full":
        return impl.FullRouter(heads, eps, kernel_config) if backend == "triton" else impl.FullRouter(heads, eps)
    if mode == "call":
        return impl.CallRouter(heads, eps)
    if backend == "triton":
        if two_phase:
            warnings.warn("two_phase applies to the torch backend; the triton block router routes with its fused "
                          "kernels", stacklevel=2)
        return impl.BlockRouter(heads, eps, span, kernel_config)
    return impl.BlockRouter(heads, eps, span, two_phase)


def route(sources: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float = 1e-6,
          backend: str = "torch") -> Tensor:
    """Multi-head depth routing. sources [N, B, T, D], query and norm_weight [D] -> [B, T, D].

    backend="torch" runs the reference; backend="triton" the fused kernels (CUDA, or the Triton
    interpreter with TRITON_INTERPRET=1). An unknown backend is an error, never a silent fallback.
    """
    check_backend(backend)
    check_route_args(sources, query, norm_weight, heads)
    if backend == "torch":
        return route_reference(sources, query, norm_weight, heads, eps)
    from mhar_lit.kernels.routing_triton import route_triton

    return route_triton(sources, query, norm_weight, heads, eps)


def register_state_pytree(cls: type, tensor_fields: tuple[str, ...], static_fields: tuple[str, ...] = ()) -> type:
    """Make a router state class a pytree node whose leaves are its tensors (module-output hooks, such as
    FSDP's pre-backward all-gather, must find the tensors of the state a DecoderLayer returns). List fields
    are flattened element by element."""
    from torch.utils import _pytree

    def flatten(state):
        return [getattr(state, f) for f in tensor_fields], (tuple(getattr(state, f) for f in static_fields),)

    def unflatten(values, context):
        state = cls.__new__(cls)
        for name, value in zip(tensor_fields, values):
            setattr(state, name, value)
        for name, value in zip(static_fields, context[0]):
            setattr(state, name, value)
        return state

    _pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
    return cls
