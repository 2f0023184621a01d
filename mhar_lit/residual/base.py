"""The residual-strategy contract shared by every method.

A strategy owns the depth state of one forward pass (a stream, n streams, or a list of sources) and
answers four questions for the model's fixed depth loop (see mhar_lit.models.decoder):

    begin(embedding)              -> state        the depth state before the first sublayer
    sublayer_input(state, s)      -> x_s          what sublayer s (2l = attention, 2l+1 = MLP) reads
    sublayer_output(state, s, y)  -> state        what the state keeps of the sublayer's output y_s
    final(state)                  -> h            what the final RMSNorm and LM head read

Parameters are created in `build(config)`, called once by the model through `bind`, because their shapes
depend on the model (width, depth) while the strategy's own options come from YAML. To add a method,
subclass ResidualStrategy, implement the four methods (and `build`/`reset_parameters` if it has
parameters) and select it by class path:

    model:
      residual:
        class_path: my_pkg.MyResidual
        init_args: {...}

A strategy's identity (what a checkpoint or a converted directory records, what a resume compares, how
tables name it) comes from its `__init__` arguments, read back from the same-named attributes: store every
argument as `self.<name>` and `to_config()` / `from_config()` / `method_label()` work without further code.
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Optional

from torch import Tensor, nn

from mhar_lit.config import ModelConfig
from mhar_lit.errors import UserError

# Packages whose strategy classes a checkpoint or converted directory may name; any other class path must be
# allowed explicitly by the user (a data file must never choose which code is imported).
ALLOWED_PACKAGES = ("mhar_lit.residual",)


def layer_of(site: int) -> int:
    return site // 2


def is_attention_site(site: int) -> bool:
    return site % 2 == 0


class ResidualStrategy(nn.Module, ABC):
    """Base class of all residual strategies; see the module docstring for the contract."""

    def __init__(self) -> None:
        super().__init__()
        self.model_config: Optional[ModelConfig] = None

    def bind(self, config: ModelConfig) -> None:
        """Called once by the model: create parameters for this width and depth."""
        if self.model_config is not None:
            raise RuntimeError(f"{type(self).__name__} is already bound to a model; create one strategy per model")
        self.model_config = config
        self.build(config)
        self.reset_parameters()

    def build(self, config: ModelConfig) -> None:
        """Create the strategy's parameters (none by default)."""

    def reset_parameters(self) -> None:
        """Initialise the strategy's parameters (nothing by default)."""

    @abstractmethod
    def begin(self, embedding: Tensor) -> Any: ...

    @abstractmethod
    def sublayer_input(self, state: Any, site: int) -> Tensor: ...

    @abstractmethod
    def sublayer_output(self, state: Any, site: int, output: Tensor) -> Any: ...

    @abstractmethod
    def final(self, state: Any) -> Tensor: ...

    # Init arguments that change speed, not the function: a run may resume with other values, so they are left
    # out of `identity()`. A subclass with other such arguments overrides this.
    speed_options: frozenset[str] = frozenset({"two_phase"})
    # Init arguments shown in `method_label()` (those the class takes), in this order.
    label_options: tuple[str, ...] = ("heads", "streams", "dynamic", "variant", "layers_per_block")

    # ---------------------------------------------------------------- identity
    @classmethod
    def class_path(cls) -> str:
        return f"{cls.__module__}.{cls.__qualname__}"

    def to_config(self) -> dict[str, Any]:
        """{"class_path", "init_args"}: every `__init__` argument with the value this instance stored, as
        JSON-serialisable values (tuples become lists). The same form as a YAML config's model.residual."""
        cls = type(self)
        init_args = {}
        for name in init_parameters(cls):
            if not hasattr(self, name):
                raise TypeError(f"{cls.__qualname__}: __init__ argument {name!r} is not stored as an attribute of "
                                f"the same name (self.{name} = {name}), so the strategy cannot be saved and rebuilt")
            init_args[name] = _json_value(getattr(self, name), f"{cls.__qualname__}.{name}")
        return {"class_path": cls.class_path(), "init_args": init_args}

    def identity(self) -> dict[str, Any]:
        """`to_config()` without the speed options: equal identities compute the same function."""
        return without_speed_options(self.to_config(), type(self).speed_options)

    def method_label(self) -> str:
        """The method's name in run tags and `compare` tables: class name plus its main options,
        e.g. `FullAttnRes(heads=8)`; the standard residual is `StandardResidual`."""
        names = init_parameters(type(self))
        options = [f"{k}={getattr(self, k)}" for k in self.label_options if k in names and hasattr(self, k)]
        name = type(self).__name__
        return f"{name}({', '.join(options)})" if options else name

    @staticmethod
    def from_config(config: Mapping[str, Any], allowed: tuple[str, ...] = ALLOWED_PACKAGES,
                    overrides: Optional[Mapping[str, Any]] = None) -> "ResidualStrategy":
        """The strategy a `to_config()` dict describes. Its class must lie in one of the `allowed` packages
        or be named exactly in `allowed` (a class path the user chose); `overrides` replace init args the
        class takes (others are ignored: e.g. a routing backend for a strategy without routing).
        Files written before init_args was the key stored "options": both are read."""
        if not isinstance(config, Mapping) or not isinstance(config.get("class_path"), str):
            raise UserError(f"a residual strategy description needs a 'class_path' string, got {config!r}")
        cls = resolve_strategy_class(config["class_path"], allowed)
        init_args = dict(config.get("init_args", config.get("options")) or {})
        params = init_parameters(cls)
        init_args = {k: v for k, v in init_args.items() if k in params or k not in RETIRED_ARGS}
        unknown = sorted(set(init_args) - set(params))
        if unknown and not _takes_any_keyword(cls):
            raise UserError(f"{config['class_path']} does not take the init args {unknown}; it takes {list(params)}")
        init_args.update({k: v for k, v in (overrides or {}).items() if k in params})
        return cls(**init_args)

    def num_extra_parameters(self) -> int:
        """Parameters this strategy adds on top of the standard Transformer."""
        return sum(p.numel() for p in self.parameters())

    def no_decay_parameter_names(self) -> set[str]:
        """Names (relative to the strategy) of parameters that the 'exclude' weight-decay option skips."""
        return set()


def init_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The named arguments of `cls.__init__` (no self, *args, **kwargs)."""
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    params = inspect.signature(cls.__init__).parameters
    return {n: p for i, (n, p) in enumerate(params.items()) if i > 0 and p.kind not in skip}


def _takes_any_keyword(cls: type) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())


def _json_value(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v, where) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _json_value(v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"{where} = {value!r} is not JSON-serialisable (None, bool, number, str, list or str-keyed dict)")


# Init arguments the routing strategies took before the routing backend and kernel tuning became runtime choices
# (`set_routing_backend`): checkpoints and converted directories written then list them; they are dropped on read.
RETIRED_ARGS = frozenset({"backend", "triton_chunk", "triton_group", "triton_options", "triton_shared_buffer"})


def without_speed_options(config: Mapping[str, Any], speed_options: frozenset[str]) -> dict[str, Any]:
    """A to_config() dict without the speed options (also of files that stored init_args as "options")."""
    init_args = config.get("init_args", config.get("options")) or {}
    dropped = speed_options | RETIRED_ARGS
    return {"class_path": config.get("class_path"),
            "init_args": {k: v for k, v in init_args.items() if k not in dropped}}


def resolve_strategy_class(class_path: str, allowed: tuple[str, ...] = ALLOWED_PACKAGES) -> type:
    """The ResidualStrategy subclass at `class_path`, imported only if it lies in an allowed package or is
    named exactly in `allowed`; anything else is refused before any import."""
    module_name, _, class_name = class_path.rpartition(".")
    trusted = any(class_path == a or module_name == a or module_name.startswith(a + ".") for a in allowed)
    if not module_name or not trusted:
        raise UserError(
            f"residual class_path {class_path!r} is not in the allowed packages ({', '.join(ALLOWED_PACKAGES)}), so "
            "it was not imported (a file must not choose which code runs). If you trust the file and wrote that "
            f"class, allow it by name: --allow_class {class_path} (probe), or allowed=(..., {class_path!r})")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise UserError(f"cannot import residual class_path {class_path!r}: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, ResidualStrategy)):
        raise UserError(f"residual class_path {class_path!r} is not a ResidualStrategy subclass")
    return cls
