"""A trained Lightning checkpoint of any residual strategy -> a standalone model directory.

    model.safetensors + mhar_config.json   the converted-directory format (mhar_lit.load_pretrained, lm-eval)
    config.json + modeling_mhar.py + mhar_*.py
                                           transformers with trust_remote_code, without mhar_lit installed
    tokenizer.json + tokenizer_config.json (AutoTokenizer, with the EOS) + generation_config.json (the EOS id)

format="hf" instead writes a plain Llama / Qwen3 directory (mhar_lit.convert.core.write_hf: weights under
transformers' names, config.json, tokenizer), which only a standard-residual model has.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from mhar_lit.config import ModelConfig
from mhar_lit.convert.core import write_hf, write_pretrained
from mhar_lit.convert.hf_config import ConversionError
from mhar_lit.convert.io import check_output, staged_directory
from mhar_lit.errors import UserError
from mhar_lit.export.remote_code import MODELING_FILE, flat_module_name, remote_code_files
from mhar_lit.export.tokenizer import write_tokenizer

FORMATS = ("mhar", "hf")
_DTYPES = ("float32", "bfloat16", "float16")


def _load(ckpt: str, trust_pickle: bool, allow_unverified: bool, tokenizer: Optional[str]):
    """The checkpoint's contents (verified, fp32 model, tokenizer source) from the one checkpoint reader."""
    from mhar_lit.checkpoint import read_checkpoint

    try:
        return read_checkpoint(ckpt, tokenizer=tokenizer, trust_pickle=trust_pickle,
                               allow_unverified=allow_unverified)
    except (OSError, UserError) as err:  # the export's errors are ConversionErrors (UserErrors too)
        raise ConversionError(str(err)) from None


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


def _write_tokenizer(out: Path, tokenizer: tuple, config: ModelConfig) -> int:
    """tokenizer.json, tokenizer_config.json and generation_config.json (the EOS id); returns the EOS id."""
    eos_id = write_tokenizer(*tokenizer, out, config.vocab_size, config.max_position_embeddings)
    _write_json(out / "generation_config.json", {"eos_token_id": eos_id})
    return eos_id


def _write_mhar(model: Any, out: Path, source: dict[str, Any], dtype: str, tokenizer: tuple) -> None:
    """Everything of format "mhar" into the (empty) directory `out`."""
    meta = write_pretrained(model, out, source=source, dtype=dtype)
    eos_id = _write_tokenizer(out, tokenizer, model.config)
    _write_json(out / "config.json", _transformers_config(meta, dtype, eos_id))
    strategy_module = meta["residual"]["class_path"].rpartition(".")[0]
    for name, text in remote_code_files(strategy_module).items():
        (out / name).write_text(text)


def _write_hf(model: Any, out: Path, dtype: str, tokenizer: tuple) -> None:
    """Everything of format "hf" into the (empty) directory `out`: a plain Llama / Qwen3 directory."""
    write_hf(model, out, dtype, eos_token_id=_write_tokenizer(out, tokenizer, model.config))


def export_checkpoint(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: Optional[str] = None,
                      overwrite: bool = False, format: str = "mhar", tokenizer: Optional[str] = None,
                      trust_pickle: bool = False, allow_unverified: bool = False) -> Path:
    """Write the model of a Lightning checkpoint as a standalone directory (see the module docstring).

    dtype: float32 / bfloat16 / float16, or None to keep the checkpoint's. tokenizer: 'bytes' or a
    tokenizer.json, instead of the one the run's datamodule recorded. trust_pickle: allow a checkpoint with
    pickled Python objects (only for files you created). allow_unverified: accept a checkpoint without a
    sha256 sidecar (one whose sidecar does not match is always refused). The directory is written beside `out_dir` and
    renamed into place; an existing non-empty `out_dir` is refused unless `overwrite`.
    """
    if format not in FORMATS:
        raise ConversionError(f"unknown export format {format!r}; choose one of {FORMATS}")
    if dtype is not None and dtype not in _DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r}; choose one of {_DTYPES} (or none: the checkpoint's)")
    check_output(out_dir, overwrite)  # before loading a large checkpoint
    if Path(out_dir).resolve() in Path(ckpt_path).resolve().parents:
        raise ConversionError(f"output directory {out_dir} contains the checkpoint {ckpt_path}; choose another --to")
    contents = _load(str(ckpt_path), trust_pickle, allow_unverified, tokenizer)
    model, stored = contents.model, contents.stored_dtype
    dtype = dtype or (stored if stored in _DTYPES else "float32")
    if format == "hf" and not model.residual.is_standard_residual:
        raise ConversionError(f"--format hf needs a standard-residual model; {ckpt_path} has "
                              f"{model.residual.method_label()}, which transformers' Llama / Qwen3 cannot express "
                              "(use --format mhar)")
    spec = contents.tokenizer_source
    source = {"checkpoint": str(Path(ckpt_path).absolute())}
    with staged_directory(out_dir, overwrite) as out:
        if format == "hf":
            _write_hf(model, out, dtype, spec)
        else:
            _write_mhar(model, out, source, dtype, spec)
    return Path(out_dir)
