"""Capturing the exact sources every routing site of a model routes over.

The model's depth loop hands each site its stacked sources through `RoutedResidual.route_sources(sources,
site)`; wrapping that one method on the strategy *instance* sees exactly what the site mixes, whatever the
strategy builds its sources from (Full: embedding + raw outputs; Block: block sums + partial; Delta: null
source + block deltas). The forward pass itself is unchanged: the wrapper calls the original method.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from mhar_lit.residual.attnres import RoutedResidual

SiteObserver = Callable[[int, Tensor], None]  # (site, sources [N, B, T, D]) -> None


def routed_residual(model: nn.Module) -> RoutedResidual:
    """The model's routing strategy, or a clear error for strategies without depth routing."""
    residual = getattr(model, "residual", None)
    if not isinstance(residual, RoutedResidual):
        name = type(residual).__name__ if residual is not None else "none"
        raise ValueError(
            f"the probe needs a model with depth routing (FullAttnRes, BlockAttnRes or DeltaAttnRes); "
            f"this model's residual strategy is {name}, which has no routing queries"
        )
    return residual


@contextlib.contextmanager
def observe_sources(model: nn.Module, observer: SiteObserver) -> Iterator[RoutedResidual]:
    """Within the block, every route_sources call first passes (site, detached stacked sources) to observer."""
    residual = routed_residual(model)
    if "route_sources" in vars(residual):
        raise RuntimeError("route_sources is already wrapped on this strategy (nested observe_sources?)")
    original = residual.route_sources  # the bound class method

    def wrapped(sources: list[Tensor], site: int) -> Tensor:
        # Stack exactly as RoutedResidual.route_sources does, so the observer sees the routed tensor.
        stacked = torch.stack(sources) if len(sources) > 1 else sources[0].unsqueeze(0)
        observer(site, stacked.detach())
        return original(sources, site)

    # An instance attribute shadows the method; plain functions are not registered by nn.Module.
    object.__setattr__(residual, "route_sources", wrapped)
    try:
        yield residual
    finally:
        object.__delattr__(residual, "route_sources")


@torch.no_grad()
def capture_sources(model: nn.Module, input_ids_BT: Tensor) -> dict[int, Tensor]:
    """{site: sources [N, B, T, D]} of one no-grad forward pass (keeps everything: small inputs only)."""
    captured: dict[int, Tensor] = {}

    def keep(site: int, sources_NBTD: Tensor) -> None:
        captured[site] = sources_NBTD.clone()

    with observe_sources(model, keep):
        model(input_ids_BT)
    return captured
