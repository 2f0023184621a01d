"""Hugging Face `config.json` <-> ModelConfig for the Llama and Qwen3 families (no transformers import).

Both families are the same pre-norm SwiGLU decoder as mhar_lit's DecoderLM; Qwen3 adds a per-head q/k
RMSNorm (`qk_norm`). Anything the decoder cannot represent (biases, sliding windows, other activations or
RoPE types) is refused with an error naming the config.json field, so a conversion never silently
changes the function.
"""

from __future__ import annotations

from typing import Any

from mhar_lit.config import TRANSFORMERS_KEYS, ModelConfig
from mhar_lit.errors import UserError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
_MODEL_TYPE_OF = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# ModelConfig fields a config.json must give; the others fall back to transformers' defaults where they differ
# from ModelConfig's (no tying, as many kv heads as heads) or to ModelConfig's (head_dim = hidden / heads).
_REQUIRED = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "rms_norm_eps")
_TRANSFORMERS_DEFAULTS = {"tie_embeddings": False}
_TYPES = {"rms_norm_eps": float, "tie_embeddings": bool}  # the other mapped fields are ints


class ConversionError(UserError):
    """A checkpoint or config that cannot be converted; the message names the file, tensor or field."""


def architecture_of(hf: dict[str, Any], where: str = "config.json") -> str:
    """'LlamaForCausalLM' or 'Qwen3ForCausalLM'; anything else is refused."""
    archs = hf.get("architectures") or []
    if not archs and hf.get("model_type") in _MODEL_TYPE_OF:
        archs = [_MODEL_TYPE_OF[hf["model_type"]]]
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ConversionError(
            f"{where}: unsupported field 'architectures' = {archs!r} (model_type {hf.get('model_type')!r}); "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    return archs[0]


def _refuse(hf: dict[str, Any], key: str, allowed: tuple, where: str) -> None:
    """Refuse a field whose value the decoder cannot reproduce (absent counts as the first allowed value)."""
    value = hf.get(key, allowed[0])
    if value not in allowed:
        raise ConversionError(f"{where}: unsupported field {key!r} = {value!r} (supported: {list(allowed)})")


def _rope(hf: dict[str, Any], where: str) -> tuple[float, Any]:
    """(rope_theta, rope_scaling) from either transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ConversionError(f"{where}: missing field 'rope_theta' (or 'rope_parameters.rope_theta')")
    scaling = {k: v for k, v in {**legacy, **params}.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ConversionError(f"{where}: unsupported field 'rope_type' = {rope_type!r} (supported: default, llama3)")
    missing = [k for k in _ROPE_KEYS if k not in scaling]
    if missing:
        raise ConversionError(f"{where}: llama3 rope scaling lacks fields {missing}")
    return float(theta), {"rope_type": "llama3", **{k: scaling[k] for k in _ROPE_KEYS}}


def model_config_from_hf(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """ModelConfig equivalent to a Llama / Qwen3 config.json (raises ConversionError naming the field)."""
    arch = architecture_of(hf, where)
    _refuse(hf, "hidden_act", ("silu",), where)
    _refuse(hf, "attention_bias", (False,), where)
    _refuse(hf, "mlp_bias", (False,), where)
    _refuse(hf, "use_sliding_window", (False,), where)
    _refuse(hf, "pretraining_tp", (1,), where)
    values = dict(_TRANSFORMERS_DEFAULTS)
    for ours, theirs in TRANSFORMERS_KEYS.items():
        if hf.get(theirs) is not None:
            values[ours] = _TYPES.get(ours, int)(hf[theirs])
        elif ours in _REQUIRED:
            raise ConversionError(f"{where}: missing field {theirs!r}")
    values.setdefault("num_kv_heads", values["num_heads"])
    theta, scaling = _rope(hf, where)
    try:
        return ModelConfig(**values, rope_theta=theta, rope_scaling=scaling, qk_norm=arch == "Qwen3ForCausalLM",
                           name=str(hf.get("_name_or_path") or arch))
    except ValueError as err:  # ModelConfig's own validation, e.g. heads not dividing
        raise ConversionError(f"{where}: {err}") from err


def hf_config_from_model(cfg: ModelConfig, architecture: str) -> dict[str, Any]:
    """A transformers-loadable config.json dict (rope in both the 5.x and the 4.x spelling)."""
    if architecture not in ARCHITECTURES:
        raise ConversionError(f"cannot export architecture {architecture!r}; supported: {sorted(ARCHITECTURES)}")
    if cfg.qk_norm != (architecture == "Qwen3ForCausalLM"):
        raise ConversionError(
            f"qk_norm={cfg.qk_norm} cannot be expressed as {architecture} (Qwen3 has q/k norms, Llama has none)"
        )
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope_parameters = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    out = {
        "architectures": [architecture],
        "model_type": ARCHITECTURES[architecture],
        **cfg.transformers_fields(),
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_parameters": rope_parameters,
        "rope_theta": cfg.rope_theta,
    }
    if architecture == "LlamaForCausalLM":
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    return out
