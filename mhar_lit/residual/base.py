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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

from torch import Tensor, nn

from mhar_lit.config import ModelConfig


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

    def num_extra_parameters(self) -> int:
        """Parameters this strategy adds on top of the standard Transformer."""
        return sum(p.numel() for p in self.parameters())

    def no_decay_parameter_names(self) -> set[str]:
        """Names (relative to the strategy) of parameters that the 'exclude' weight-decay option skips."""
        return set()


def register_state_pytree(cls: type, tensor_fields: tuple[str, ...], static_fields: tuple[str, ...] = ()) -> type:
    """Make a depth-state class a pytree node whose leaves are its tensors.

    The state is what a DecoderLayer returns; wrappers that act on a module's outputs (FSDP registers its
    pre-backward all-gather on the output tensors) must be able to find the tensors inside it. List fields
    are flattened element by element.
    """
    from torch.utils import _pytree

    def flatten(state):
        values = [getattr(state, f) for f in tensor_fields]
        static = tuple(getattr(state, f) for f in static_fields)
        return values, (static,)

    def unflatten(values, context):
        state = cls.__new__(cls)
        for name, value in zip(tensor_fields, values):
            setattr(state, name, value)
        for name, value in zip(static_fields, context[0]):
            setattr(state, name, value)
        return state

    _pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
    return cls
