"""Residual strategies for conversion: built from CLI options, recorded as their `to_config()`
({class_path, init_args}) and rebuilt from it when a converted directory is loaded."""

from __future__ import annotations

from typing import Any, Optional

from mhar_lit.convert.hf_config import ConversionError
from mhar_lit.errors import UserError
from mhar_lit.residual import BlockAttnRes, DeltaAttnRes, FullAttnRes, StandardResidual
from mhar_lit.residual.base import ALLOWED_PACKAGES, ResidualStrategy

STRATEGIES = ("delta", "standard", "full", "block")
# The strategy of a directory whose mhar_config.json names none.
STANDARD = StandardResidual().to_config()


def layers_per_block(num_layers: int, num_blocks: int) -> int:
    if num_blocks < 1 or num_layers % num_blocks != 0:
        raise ConversionError(
            f"num_hidden_layers {num_layers} is not divisible by --num-blocks {num_blocks}; "
            f"choose a divisor of {num_layers}"
        )
    return num_layers // num_blocks


def build_strategy(name: str, num_layers: int, heads: int = 8, num_blocks: int = 8,
                   legacy_block_delta: bool = False, null_source: bool = True) -> ResidualStrategy:
    """The strategy selected on the command line, blocks given as a count that must divide the depth."""
    if name == "standard":
        return StandardResidual()
    if name == "delta":
        return DeltaAttnRes(heads=heads, layers_per_block=layers_per_block(num_layers, num_blocks),
                            null_source=null_source, legacy_block_delta=legacy_block_delta)
    if name == "full":
        return FullAttnRes(heads=heads)
    if name == "block":
        return BlockAttnRes(heads=heads, layers_per_block=layers_per_block(num_layers, num_blocks))
    raise ConversionError(f"unknown strategy {name!r}; choose one of {STRATEGIES}")


def rebuild(description: dict[str, Any], backend: Optional[str] = None,
            allowed: tuple[str, ...] = ALLOWED_PACKAGES) -> ResidualStrategy:
    """The strategy of a converted directory (ResidualStrategy.from_config of its `to_config()` description);
    `backend` picks the routing backend where the strategy routes (e.g. 'torch' on a CPU machine)."""
    try:
        strategy = ResidualStrategy.from_config(description, allowed)
    except UserError as err:
        raise ConversionError(f"mhar_config.json: {err}") from err
    if backend is not None and hasattr(strategy, "set_routing_backend"):
        strategy.set_routing_backend(backend)
    return strategy
