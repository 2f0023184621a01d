"""A trained Lightning checkpoint of any residual strategy -> a standalone model directory.

    model.safetensors + mhar_config.json   the converted-directory format (mhar_lit.load_pretrained, lm-eval)
    config.json + modeling_mhar.py + mhar_*.py
                                           transformers with trust_remote_code, without mhar_lit installed
    tokenizer.json + tokenizer_config.json (AutoTokenizer, with the EOS) + generation_config.json (the EOS id)

format="hf" instead writes a plain Llama / Qwen3 directory through mhar_lit.convert.export_hf, which only a
standard-residual model has.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

from mhar_lit.convert.core import export_hf, save_pretrained
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
    """config.json for the remote-code classes (top-level sizes repeated for tools; model_config counts)."""
    cfg, residual = meta["model_config"], meta["residual"]
    return {
        "architectures": ["MharForCausalLM"],
        "model_type": "mhar",
        "auto_map": {"AutoConfig": f"{MODELING_FILE[:-3]}.MharConfig",
                     "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.MharForCausalLM"},
        "model_config": cfg,
        "residual": residual,
        "residual_module": flat_module_name(residual["class_path"].rpartition(".")[0]),
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": cfg["num_layers"],
        "num_attention_heads": cfg["num_heads"],
        "num_key_value_heads": cfg["num_kv_heads"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "tie_word_embeddings": cfg["tie_embeddings"],
        "eos_token_id": eos_id,
        "use_cache": False,
        "dtype": dtype,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _write_mhar(model: Any, out: Path, source: dict[str, Any], dtype: str, tokenizer: tuple) -> None:
    """Everything of format "mhar" into the (empty) directory `out`."""
    save_pretrained(model, out, source=source, dtype=dtype, overwrite=True)
    meta = json.loads((out / "mhar_config.json").read_text())
    eos_id = write_tokenizer(*tokenizer, out, model.config.vocab_size, model.config.max_position_embeddings)
    _write_json(out / "config.json", _transformers_config(meta, dtype, eos_id))
    _write_json(out / "generation_config.json", {"eos_token_id": eos_id})
    strategy_module = meta["residual"]["class_path"].rpartition(".")[0]
    for name, text in remote_code_files(strategy_module).items():
        (out / name).write_text(text)


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
    if format == "hf" and type(model.residual).__name__ != "StandardResidual":
        raise ConversionError(f"--format hf needs a standard-residual model; {ckpt_path} has "
                              f"{type(model.residual).__name__}, which transformers' Llama / Qwen3 cannot express "
                              "(use --format mhar)")
    spec = contents.tokenizer_source
    source = {"checkpoint": str(Path(ckpt_path).absolute())}
    if format == "hf":
        from mhar_lit.paths import nearest_existing

        beside = nearest_existing(Path(out_dir).absolute().parent)  # same file system as the output
        with tempfile.TemporaryDirectory(prefix=".mhar-export-", dir=beside) as tmp:
            _write_mhar(model, Path(tmp), source, dtype, spec)
            return export_hf(tmp, out_dir, dtype="source", overwrite=overwrite)
    with staged_directory(out_dir, overwrite) as out:
        _write_mhar(model, out, source, dtype, spec)
    return Path(out_dir)
