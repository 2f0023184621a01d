"""A trained Lightning checkpoint of any residual strategy -> a standalone model directory.

    model.safetensors + mhar_config.json   the converted-directory format (mhar_lit.load_pretrained, lm-eval)
    config.json + modeling_mhar.py + mhar_*.py
                                           transformers with trust_remote_code, without mhar_lit installed
    tokenizer.json (+ generation_config.json with the EOS id)

format="hf" instead writes a plain Llama / Qwen3 directory (mhar_lit.convert.core.write_hf: weights under
transformers' names, config.json, tokenizer), which only a standard-residual model has.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

from mhar_lit.config import ModelConfig
from mhar_lit.convert.core import write_hf, write_pretrained
from mhar_lit.convert.hf_config import ConversionError
from mhar_lit.convert.io import check_output, staged_directory
from mhar_lit.export.remote_code import MODELING_FILE, flat_module_name, remote_code_files
from mhar_lit.export.tokenizer import checkpoint_tokenizer, write_tokenizer

FORMATS = ("mhar", "hf")
_DTYPES = ("float32", "bfloat16", "float16")


def _load(ckpt: str, trust_pickle: bool) -> tuple[Any, dict[str, Any], str]:
    """The checkpoint's DecoderLM (eval mode, fp32), its datamodule settings and the dtype its weights are stored
    in (bf16 for a bf16-true run: model_from_checkpoint builds an fp32 model, which holds them exactly)."""
    from mhar_lit.lit.module import model_from_checkpoint

    try:
        model = model_from_checkpoint(str(ckpt), trust_pickle=trust_pickle)
    except (OSError, ValueError) as err:
        raise ConversionError(str(err)) from None
    checkpoint = torch.load(str(ckpt), map_location="cpu", weights_only=not trust_pickle, mmap=True)
    settings = checkpoint.get("datamodule_hyper_parameters") or {}
    stored = next((t.dtype for t in checkpoint["state_dict"].values() if t.is_floating_point()), torch.float32)
    return model, dict(settings) if isinstance(settings, dict) else {}, str(stored).removeprefix("torch.")


def _transformers_config(meta: dict[str, Any], dtype: str, eos_id: int) -> dict[str, Any]:
    """config.json for the remote-code classes (the transformers fields repeated for tools; model_config counts)."""
    return {
        "architectures": ["MharForCausalLM"],
        "model_type": "mhar",
        "auto_map": {"AutoConfig": f"{MODELING_FILE[:-3]}.MharConfig",
                     "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.MharForCausalLM"},
        "model_config": meta["model_config"],
        "residual": meta["residual"],
        "residual_module": flat_module_name(meta["residual"]["class_path"].rpartition(".")[0]),
        **ModelConfig.from_dict(meta["model_config"]).transformers_fields(),
        "eos_token_id": eos_id,
        "use_cache": False,
        "dtype": dtype,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _write_tokenizer(out: Path, tokenizer: tuple, vocab_size: int) -> int:
    """tokenizer.json and generation_config.json (the EOS id); returns the EOS id."""
    eos_id = write_tokenizer(*tokenizer, out, vocab_size)
    _write_json(out / "generation_config.json", {"eos_token_id": eos_id})
    return eos_id


def _write_mhar(model: Any, out: Path, source: dict[str, Any], dtype: str, tokenizer: tuple) -> None:
    """Everything of format "mhar" into the (empty) directory `out`."""
    meta = write_pretrained(model, out, source=source, dtype=dtype)
    eos_id = _write_tokenizer(out, tokenizer, model.config.vocab_size)
    _write_json(out / "config.json", _transformers_config(meta, dtype, eos_id))
    strategy_module = meta["residual"]["class_path"].rpartition(".")[0]
    for name, text in remote_code_files(strategy_module).items():
        (out / name).write_text(text)


def _write_hf(model: Any, out: Path, dtype: str, tokenizer: tuple) -> None:
    """Everything of format "hf" into the (empty) directory `out`: a plain Llama / Qwen3 directory."""
    eos_id = _write_tokenizer(out, tokenizer, model.config.vocab_size)
    hf = write_hf(model, out, dtype)
    _write_json(out / "config.json", {**hf, "eos_token_id": eos_id})


def export_checkpoint(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: Optional[str] = None,
                      overwrite: bool = False, format: str = "mhar", tokenizer: Optional[str] = None,
                      trust_pickle: bool = False) -> Path:
    """Write the model of a Lightning checkpoint as a standalone directory (see the module docstring).

    dtype: float32 / bfloat16 / float16, or None to keep the checkpoint's. tokenizer: 'bytes' or a
    tokenizer.json, instead of the one the run's datamodule recorded. trust_pickle: allow a checkpoint with
    pickled Python objects (only for files you created). The directory is written beside `out_dir` and
    renamed into place; an existing non-empty `out_dir` is refused unless `overwrite`.
    """
    if format not in FORMATS:
        raise ConversionError(f"unknown export format {format!r}; choose one of {FORMATS}")
    if dtype is not None and dtype not in _DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r}; choose one of {_DTYPES} (or none: the checkpoint's)")
    check_output(out_dir, overwrite)  # before loading a large checkpoint
    if Path(out_dir).resolve() in Path(ckpt_path).resolve().parents:
        raise ConversionError(f"output directory {out_dir} contains the checkpoint {ckpt_path}; choose another --to")
    model, settings, stored = _load(str(ckpt_path), trust_pickle)
    dtype = dtype or (stored if stored in _DTYPES else "float32")
    if format == "hf" and not model.residual.is_standard_residual:
        raise ConversionError(f"--format hf needs a standard-residual model; {ckpt_path} has "
                              f"{model.residual.method_label()}, which transformers' Llama / Qwen3 cannot express "
                              "(use --format mhar)")
    spec = checkpoint_tokenizer(settings, tokenizer)
    source = {"checkpoint": str(Path(ckpt_path).absolute())}
    with staged_directory(out_dir, overwrite) as out:
        if format == "hf":
            _write_hf(model, out, dtype, spec)
        else:
            _write_mhar(model, out, source, dtype, spec)
    return Path(out_dir)
