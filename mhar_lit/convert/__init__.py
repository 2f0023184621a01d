"""Pretrained checkpoints in and out of mhar_lit (safetensors only, transformers never imported).

    convert_hf(HF_DIR, OUT_DIR, strategy="delta")   Llama / Qwen3 -> DecoderLM + strategy, identity at init
    load_pretrained(OUT_DIR)                        -> DecoderLM in eval mode
    load_weights_into(model, OUT_DIR)               in-place load with shape checks (LanguageModel.init_from)
    save_pretrained(model, OUT_DIR)                 an in-memory DecoderLM (trained, EMA) -> converted dir
    export_hf(OUT_DIR, HF_DIR)                      StandardResidual dir -> transformers-loadable dir
    convert_main(argv)                              `python -m mhar_lit convert ...` (see convert/cli.py)
"""

from mhar_lit.convert.cli import convert_main
from mhar_lit.convert.core import (
    MHAR_CONFIG,
    convert_hf,
    export_hf,
    load_pretrained,
    load_weights_into,
    read_mhar_config,
    save_pretrained,
)
from mhar_lit.convert.hf_config import ConversionError, model_config_from_hf

__all__ = [
    "ConversionError",
    "MHAR_CONFIG",
    "convert_hf",
    "convert_main",
    "export_hf",
    "load_pretrained",
    "load_weights_into",
    "model_config_from_hf",
    "read_mhar_config",
    "save_pretrained",
]
