"""Residual strategies for conversion: built from CLI options, described as {class_path, init_args} and
rebuilt from that description when a converted directory is loaded."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Optional

from mhar_lit.convert.hf_config import ConversionError
from mhar_lit.residual import BlockAttnRes, DeltaAttnRes, FullAttnRes, StandardResidual
from mhar_lit.residual.base import ResidualStrategy

STRATEGIES = ("delta", "standard", "full", "block")
# Strategies whose function equals the pretrained model at init (delta: its gates start at 0).
IDENTITY_PRESERVING = ("delta", "standard")


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


def describe(strategy: ResidualStrategy) -> dict[str, Any]:
    """{class_path, init_args}: the constructor arguments read back from the same-named attributes."""
    cls = type(strategy)
    params = inspect.signature(cls.__init__).parameters
    init_args = {name: getattr(strategy, name) for name in params if name != "self" and hasattr(strategy, name)}
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}


LEGACY_RUNTIME_OPTIONS = ("backend", "triton_chunk", "triton_group", "triton_options", "triton_shared_buffer")


def rebuild(description: dict[str, Any], backend: Optional[str] = None) -> ResidualStrategy:
    """Inverse of `describe`; `backend` overrides the routing backend (e.g. 'torch' on a CPU machine)."""
    class_path = description.get("class_path", "")
    module_name, _, class_name = class_path.rpartition(".")
    if not module_name.startswith("mhar_lit."):  # never import arbitrary code named by a data file
        raise ConversionError(f"mhar_config.json: residual class_path {class_path!r} is not an mhar_lit strategy")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise ConversionError(f"mhar_config.json: cannot import residual class_path {class_path!r} ({err})") from err
    if not (isinstance(cls, type) and issubclass(cls, ResidualStrategy)):
        raise ConversionError(f"mhar_config.json: {class_path!r} is not a ResidualStrategy")
    init_args = dict(description.get("init_args") or {})
    for name in LEGACY_RUNTIME_OPTIONS:  # files written when strategies took the routing backend and knobs
        init_args.pop(name, None)
    strategy = cls(**init_args)
    if backend is not None and hasattr(strategy, "set_routing_backend"):
        strategy.set_routing_backend(backend)
    return strategy


def is_standard(description: dict[str, Any]) -> bool:
    return description.get("class_path", "").endswith(".StandardResidual")
