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

A strategy describes itself; every consumer (the training module, run tags and `compare`, conversion,
export) asks it instead of testing class names:

    __init__ arguments            its options, stored as `self.<name>`: `to_config()` / `from_config()` rebuild it
    label_options                 the options `method_label()` always shows; every other option that changes the
                                  function or the training shows whenever it is off its default
    speed_options                 options that change speed only: left out of `identity()` and the label
    is_standard_residual          the plain additive residual (transformers' Llama / Qwen3 can express it, and
                                  `compare` pairs every run against it)
    preserves_pretrained_function equal to the pretrained model at step 0 when grafted onto its weights
    routing_parameters(), routing_lr_scale
                                  the parameters the optimiser gives their own learning rate (lr x routing_lr_scale)
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Optional

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

    def bind(self, config: ModelConfig, init_weights: bool = True) -> None:
        """Called once by the model: create parameters for this width and depth (initialised unless the model
        is built to be loaded: DecoderLM's init_weights)."""
        if self.model_config is not None:
            raise RuntimeError(f"{type(self).__name__} is already bound to a model; create one strategy per model")
        self.model_config = config
        self.build(config)
        if init_weights:
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

    # ---------------------------------------------------------------- self-description (module docstring)
    label_options: ClassVar[tuple[str, ...]] = ()
    speed_options: ClassVar[frozenset[str]] = frozenset()
    is_standard_residual: ClassVar[bool] = False
    preserves_pretrained_function: ClassVar[bool] = False
    routing_lr_scale: float = 1.0

    def routing_parameters(self) -> list[nn.Parameter]:
        """The parameters that get their own optimiser group at lr x routing_lr_scale (none by default)."""
        return []

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
        """`to_config()` without the speed options: equal identities are the same method."""
        return type(self).identity_of(self.to_config())

    @classmethod
    def identity_of(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """The identity a saved `to_config()` dict describes, comparable with `identity()` of this class: speed
        options and retired arguments dropped and, for a file of this class written before one of its options
        existed, that option at its default (the file trained with it). Files that stored init_args as
        "options" are read too."""
        init_args = dict(config.get("init_args", config.get("options")) or {})
        if config.get("class_path") == cls.class_path():
            init_args = {**init_defaults(cls), **init_args}
        dropped = cls.speed_options | RETIRED_ARGS
        return {"class_path": config.get("class_path"),
                "init_args": {k: v for k, v in init_args.items() if k not in dropped}}

    def method_label(self) -> str:
        """The method's name in run tags and `compare` tables: the class name, its `label_options` (unless None)
        and every other identity option off its default, e.g. `FullAttnRes(heads=8, logit_scale=heads)`;
        two strategies of different identities get different labels."""
        cls = type(self)
        options, defaults = self.identity()["init_args"], init_defaults(cls)
        shown = [k for k in cls.label_options if options.get(k) is not None]
        shown += [k for k in options if k not in cls.label_options and options[k] != defaults.get(k, _NO_DEFAULT)]
        parts = [f"{k}={options[k]}" for k in shown]
        return f"{cls.__name__}({', '.join(parts)})" if parts else cls.__name__

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


_NO_DEFAULT = object()


def init_defaults(cls: type) -> dict[str, Any]:
    """The default of every `__init__` argument of `cls` that has one."""
    return {n: p.default for n, p in init_parameters(cls).items() if p.default is not p.empty}


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


# Init arguments the strategies no longer take, dropped when older checkpoints and converted directories are read:
# the routing backend and kernel tuning (runtime choices now, `set_routing_backend`) and HyperConnections'
# dynamic_scale_init (an init value; a saved model holds the trained scales themselves).
RETIRED_ARGS = frozenset({"backend", "triton_chunk", "triton_group", "triton_options", "triton_shared_buffer",
                          "dynamic_scale_init"})


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
