"""Model configuration: one flat, serialisable dataclass with named sizes and eager validation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

QWEN3_VOCAB = 151_936
LLAMA3_VOCAB = 128_256

# ModelConfig field -> the transformers config.json key of the same quantity: the one map behind conversion from
# and to Llama / Qwen3 (mhar_lit.convert.hf_config) and the export's own config.json (mhar_lit.export). RoPE and
# qk_norm are spelled differently per family and handled there.
TRANSFORMERS_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
}


@dataclass
class ModelConfig:
    """Shape and numerics of a Qwen3/Llama-style decoder (docs/method.md A).

    `head_dim` defaults to hidden_size // num_heads. `qk_norm` is Qwen3's per-head q/k RMSNorm before RoPE
    (Llama has none). `rope_scaling` takes the Llama-3.1 dict ({"rope_type": "llama3", "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}) or None.
    """

    vocab_size: int = QWEN3_VOCAB
    hidden_size: int = 512
    num_layers: int = 12
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 1536
    head_dim: Optional[int] = None
    rope_theta: float = 10_000.0
    rope_scaling: Optional[dict[str, Any]] = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qk_norm: bool = True
    max_position_embeddings: int = 4096
    init_std: float = 0.02
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_heads != 0:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                    "set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_heads
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "default") not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_scaling {self.rope_scaling!r}; only 'llama3' is implemented")

    @property
    def num_sites(self) -> int:
        """Sublayer routing sites: attention and MLP of every layer (the final site is extra)."""
        return 2 * self.num_layers

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def transformers_fields(self) -> dict[str, Any]:
        """The fields of TRANSFORMERS_KEYS under their transformers names."""
        return {theirs: getattr(self, ours) for ours, theirs in TRANSFORMERS_KEYS.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; known keys: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in NAMED_SIZES:
            raise ValueError(f"unknown model size {name!r}; choose one of {sorted(NAMED_SIZES)}")
        return cls.from_dict({**NAMED_SIZES[name], "name": name, **overrides})


_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# d / L / H_q / H_kv / FFN of the paper (docs/method.md A) plus the Llama-3.1-8B shape used for mid-training.
NAMED_SIZES: dict[str, dict[str, Any]] = {
    "100M": dict(hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=4, intermediate_size=1536),
    "350M": dict(hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=8, intermediate_size=4096),
    "1B": dict(hidden_size=1280, num_layers=36, num_heads=16, num_kv_heads=8, intermediate_size=5120),
    "llama-3.1-8b": dict(
        vocab_size=LLAMA3_VOCAB, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        intermediate_size=14336, rope_theta=500_000.0, rope_scaling=_LLAMA31_ROPE, rms_norm_eps=1e-5,
        tie_embeddings=False, qk_norm=False, max_position_embeddings=131_072,
    ),
    # Small shapes for CPU tests and the demo. The tiny vocabularies (320) cover the byte tokenizer's 257 ids.
    "tiny": dict(vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                 max_position_embeddings=512),
    "tiny-4l": dict(vocab_size=320, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                    intermediate_size=128, max_position_embeddings=512),
    "demo": dict(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384,
                 max_position_embeddings=512),
}
