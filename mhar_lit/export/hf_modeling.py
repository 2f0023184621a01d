"""transformers classes around DecoderLM: the template of an export's `modeling_mhar.py` (trust_remote_code).

An export copies this file, with the mhar_lit modules it needs, into the export directory as flat modules
(mhar_lit.export.remote_code), so `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` works
where mhar_lit is not installed. It relies on mhar_lit for ModelConfig, DecoderLM and the residual strategy
named in config.json only. Inside the package it works as is (transformers must be installed).

There is no KV cache: every generation step re-runs the whole sequence (exact, O(T^2) per step), and the
attention mask must be all ones (DecoderLM has no padding).
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from mhar_lit.config import ModelConfig
from mhar_lit.models.decoder import DecoderLM

# <flat module manifest>
_STANDARD = {"class_path": "mhar_lit.residual.standard.StandardResidual", "init_args": {}}


class MharConfig(PretrainedConfig):
    """`model_config`: ModelConfig fields; `residual`: {class_path, init_args}; `residual_module`: the flat module
    of the strategy class in an export. The usual transformers fields are derived from `model_config`."""

    model_type = "mhar"

    def __init__(self, model_config: Optional[dict[str, Any]] = None, residual: Optional[dict[str, Any]] = None,
                 residual_module: Optional[str] = None, **kwargs: Any) -> None:
        model = ModelConfig.from_dict(dict(model_config or {}))
        self.model_config = model.to_dict()
        self.residual = dict(residual or _STANDARD)
        self.residual_module = residual_module
        for key, value in model.transformers_fields().items():  # config.json repeats them for tools
            kwargs.pop(key, None)
            setattr(self, key, value)
        kwargs.setdefault("use_cache", False)
        super().__init__(tie_word_embeddings=model.tie_embeddings, **kwargs)


def _strategy_class(config: MharConfig) -> type:
    module, _, name = config.residual["class_path"].rpartition(".")
    if __name__.startswith("mhar_lit."):  # this file inside the package
        if not module.startswith("mhar_lit."):
            raise ValueError(f"residual class_path {config.residual['class_path']!r} is not an mhar_lit strategy")
        return getattr(importlib.import_module(module), name)
    if not config.residual_module:
        raise ValueError("config.json lacks 'residual_module', the exported module of the residual strategy")
    return getattr(importlib.import_module(f".{config.residual_module}", __package__), name)


def build_strategy(config: MharConfig) -> Any:
    """The residual strategy with its saved constructor arguments (routing on the PyTorch path, the default:
    the fused Triton kernels are not part of an export)."""
    return _strategy_class(config)(**dict(config.residual.get("init_args") or {}))


class MharForCausalLM(PreTrainedModel, GenerationMixin):
    """DecoderLM under `model.` (safetensors names without the prefix load through base_model_prefix)."""

    config_class = MharConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["DecoderLayer"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MharConfig) -> None:
        super().__init__(config)
        self.model = DecoderLM(ModelConfig.from_dict(config.model_config), build_strategy(config))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: DecoderLM and its strategy initialise themselves when built, and every tensor of a saved
        model is loaded (transformers' generic init would overwrite routing parameters it does not know)."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def _rotary_ready(self) -> None:
        # RoPE frequencies are a computed tensor, not a weight: a model built on the meta device (as
        # from_pretrained does) must compute them again before its first forward.
        rotary = self.model.rotary
        if rotary.inv_freq.is_meta:
            self.model.rotary = type(rotary)(self.model.config)

    def forward(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None, **kwargs: Any) -> CausalLMOutputWithPast:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("MharForCausalLM has no padding support: the attention mask must be all ones "
                             "(run sequences of different lengths separately)")
        self._rotary_ready()
        logits = self.model(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
                                      **kwargs: Any) -> dict[str, Any]:
        """The whole sequence at every step (no cache)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}
