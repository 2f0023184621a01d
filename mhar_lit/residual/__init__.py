"""Residual strategies: how sublayers are wired across depth. See base.py for the contract."""

from mhar_lit.residual.attnres import BlockAttnRes, FullAttnRes, RoutedResidual
from mhar_lit.residual.base import ResidualStrategy
from mhar_lit.residual.delta import DeltaAttnRes
from mhar_lit.residual.hyper import HyperConnections
from mhar_lit.residual.standard import StandardResidual

__all__ = [
    "ResidualStrategy",
    "StandardResidual",
    "HyperConnections",
    "RoutedResidual",
    "FullAttnRes",
    "BlockAttnRes",
    "DeltaAttnRes",
]
