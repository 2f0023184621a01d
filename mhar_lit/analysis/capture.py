"""Capturing the exact sources every routing site of a model routes over.

Every routing site of a RoutedResidual passes its stacked sources to the strategy's `source_observer`; setting
it sees exactly what the site mixes, whatever the strategy builds its sources from (Full: embedding + raw
outputs; Block: block sums + partial; Delta: null source + block deltas). The forward pass is unchanged.
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
    """Within the block, every routing site passes (site, detached stacked sources) to observer."""
    residual = routed_residual(model)
    if residual.source_observer is not None:
        raise RuntimeError("this strategy's sources are already observed (nested observe_sources?)")
    residual.source_observer = observer
    try:
        yield residual
    finally:
        residual.source_observer = None


@torch.no_grad()
def capture_sources(model: nn.Module, input_ids_BT: Tensor) -> dict[int, Tensor]:
    """{site: sources [N, B, T, D]} of one no-grad forward pass (keeps everything: small inputs only)."""
    captured: dict[int, Tensor] = {}

    def keep(site: int, sources_NBTD: Tensor) -> None:
        captured[site] = sources_NBTD.clone()

    with observe_sources(model, keep):
        model(input_ids_BT)
    return captured
