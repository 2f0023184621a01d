"""Router interfaces and the public per-call `route` (contract: the package docstring); make_router: factory.py."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

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
