"""make_router: the router of a mode on a backend (the one place that maps a backend name to its implementation)."""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Optional

from mhar_lit.routing.routers import MODES, check_backend


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
