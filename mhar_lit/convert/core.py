"""Hugging Face checkpoints -> mhar_lit converted directories and back, plus loading them.

A converted directory holds
    model.safetensors (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
        every DecoderLM tensor under its DecoderLM name (`embed_tokens.weight`, `layers.0.self_attn.q_proj.weight`,
        ..., `residual.gate`); a tied lm_head is stored once, as `embed_tokens.weight`
    mhar_config.json
        {"format", "model_config" (ModelConfig fields), "residual" ({class_path, init_args}), "source" (...)}
    tokenizer files copied from the source, when it had them.

Pretrained tensors are copied bit for bit (same dtype unless --dtype asks otherwise); the strategy's
parameters are written in fp32 with the strategy's own init, which for DeltaAttnRes makes the converted
model exactly the pretrained function (docs/method.md E).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from mhar_lit.config import ModelConfig
from mhar_lit.convert import strategies
from mhar_lit.convert.hf_config import (
    ConversionError,
    architecture_of,
    hf_config_from_model,
    model_config_from_hf,
)
from mhar_lit.convert.io import DEFAULT_MAX_SHARD_BYTES, Planned, TensorReader, staged_directory, write_tensors
from mhar_lit.models.decoder import DecoderLM, unloaded_decoder
from mhar_lit.residual.base import ResidualStrategy

log = logging.getLogger(__name__)

MHAR_CONFIG = "mhar_config.json"
FORMAT = "mhar_lit.converted/1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
# Fields that change the function; the rest (name, init_std, max_position_embeddings) may differ.
_FUNCTIONAL_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                      "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps", "tie_embeddings", "qk_norm")
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------- helpers
def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise ConversionError(f"{path} not found") from err
    except OSError as err:  # unreadable, or a directory
        raise ConversionError(f"{path}: cannot read ({err.strerror or err})") from err
    except ValueError as err:
        raise ConversionError(f"{path}: invalid JSON ({err})") from err


def _parse_dtype(dtype: Optional[str | torch.dtype]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "source":
        return None if dtype == "source" else dtype
    if dtype not in _DTYPE_NAMES:
        raise ConversionError(f"unknown dtype {dtype!r}; choose source, {', '.join(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[dtype]


def _meta_model(cfg: ModelConfig, strategy: ResidualStrategy) -> DecoderLM:
    """The model's structure without allocating or initialising its weights."""
    with torch.device("meta"):
        return DecoderLM(cfg, strategy, init_weights=False)


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `model` must hold (a tied lm_head counts once, as the embedding)."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if model.config.tie_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else f"model.{name}"


def _check_shape(source: str, name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ConversionError(f"{source}: shape mismatch for tensor {name!r}: checkpoint {list(got)}, model {list(want)}")


def _check_separate(src: Path, dst: Path) -> None:
    """The output must be neither the source directory nor contain it nor lie inside it: writing it (with
    --overwrite) would otherwise replace or mix into the source."""
    source, output = src.resolve(), dst.resolve()
    relation = ("is" if output == source else "is inside" if source in output.parents
                else "contains" if output in source.parents else None)
    if relation:
        raise ConversionError(f"output directory {output} {relation} the source directory {source}; "
                              "choose a --to outside the source")


def _check_tokenizer(src: Path, vocab_size: int) -> None:
    """A tokenizer.json to be copied with the model must not produce ids past the model's embedding."""
    file = src / "tokenizer.json"
    if not file.is_file():
        return
    from mhar_lit.data.tokenizer import read_tokenizer_json

    try:
        count = read_tokenizer_json(file).get_vocab_size(with_added_tokens=True)
    except ValueError as err:
        raise ConversionError(str(err)) from None
    if count > vocab_size:
        raise ConversionError(f"{file}: the tokenizer has {count} token ids but the model's vocab_size is "
                              f"{vocab_size}; ids >= {vocab_size} have no embedding")


def _copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def _cast(dtype: Optional[torch.dtype]):
    return (lambda t: t) if dtype is None else (lambda t: t.to(dtype) if t.is_floating_point() else t)


def _pretrained_plan(reader: TensorReader, shapes: dict[str, tuple[int, ...]], dtype: Optional[torch.dtype],
                     tied: bool) -> list[Planned]:
    """Map the HF tensors onto DecoderLM names, checking presence and shapes before anything is written."""
    wanted = {_hf_name(n): n for n in shapes if not n.startswith("residual.")}
    ignorable = {"lm_head.weight"} if tied else set()  # some tied checkpoints still store the head
    unexpected = [k for k in reader.keys() if k not in wanted and k not in ignorable and not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise ConversionError(f"{reader.path}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all); "
                              "the architecture has parameters DecoderLM does not (biases?)")
    cast, plan = _cast(dtype), []
    for hf_name, name in wanted.items():
        if hf_name not in reader:
            raise ConversionError(f"{reader.path}: missing tensor {hf_name!r} (DecoderLM {name!r})")
        _check_shape(str(reader.path), hf_name, reader.shape(hf_name), shapes[name])
        itemsize = (dtype or reader.dtype(hf_name)).itemsize
        nbytes = reader.nbytes(hf_name) // reader.dtype(hf_name).itemsize * itemsize
        plan.append((name, nbytes, lambda k=hf_name: cast(reader.get(k))))
    return plan


def _residual_plan(cfg: ModelConfig, strategy: ResidualStrategy) -> list[Planned]:
    """The strategy's freshly initialised parameters (fp32), from a twin bound outside any model."""
    twin = strategies.rebuild(strategy.to_config())
    twin.bind(cfg)
    return [(f"residual.{k}", v.numel() * v.element_size(), lambda v=v: v.float())
            for k, v in twin.state_dict().items()]


# ---------------------------------------------------------------------------------------------- HF -> ours
def convert_hf(src: str | os.PathLike, dst: str | os.PathLike, strategy: str = "delta", heads: int = 8,
               num_blocks: int = 8, legacy_block_delta: bool = False, null_source: bool = True,
               dtype: Optional[str] = "source", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
               overwrite: bool = False) -> Path:
    """Convert a Llama / Qwen3 Hugging Face directory into an mhar_lit directory with `strategy` grafted on."""
    src, dst = Path(src), Path(dst)
    _check_separate(src, dst)
    hf = _read_json(src / "config.json")
    cfg = model_config_from_hf(hf, where=str(src / "config.json"))
    _check_tokenizer(src, cfg.vocab_size)
    residual = strategies.build_strategy(strategy, cfg.num_layers, heads, num_blocks, legacy_block_delta,
                                         null_source)
    shapes = expected_shapes(_meta_model(cfg, residual))
    if not residual.preserves_pretrained_function:
        log.warning("strategy %r does not preserve the pretrained function at init", strategy)
    with TensorReader(src) as reader:
        plan = _pretrained_plan(reader, shapes, _parse_dtype(dtype), cfg.tie_embeddings)
        plan += _residual_plan(cfg, residual)
        source = {"path": str(src.absolute()), "architecture": architecture_of(hf), "config": hf}
        with staged_directory(dst, overwrite) as out:
            _write_directory(out, plan, cfg, residual, source, max_shard_bytes)
            _copy_tokenizer_files(src, out)
    return dst


def _write_directory(out: Path, plan: list[Planned], cfg: ModelConfig, residual: ResidualStrategy,
                     source: Optional[dict[str, Any]], max_shard_bytes: int) -> dict[str, Any]:
    """The tensors and mhar_config.json; returns what mhar_config.json holds."""
    files = write_tensors(plan, out, max_shard_bytes, metadata={"mhar_lit": FORMAT})
    meta = {
        "format": FORMAT,
        "model_config": cfg.to_dict(),
        "residual": residual.to_config(),
        "identity_preserving_init": residual.preserves_pretrained_function,
        "source": source,
        "files": files,
    }
    _write_json(out / MHAR_CONFIG, meta)
    return meta


# ---------------------------------------------------------------------------------------------- ours -> disk
def _model_plan(model: DecoderLM, dtype: Optional[str], name_of=lambda name: name) -> list[Planned]:
    """Every tensor a checkpoint of `model` holds (a tied lm_head once), cast to `dtype`, under name_of(name)."""
    cast, shapes = _cast(_parse_dtype(dtype)), expected_shapes(model)
    return [(name_of(name), t.numel() * t.element_size(), lambda t=t: cast(t))
            for name, t in model.state_dict().items() if name in shapes]


def write_pretrained(model: DecoderLM, out: Path, source: Optional[dict[str, Any]] = None,
                     dtype: Optional[str] = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, Any]:
    """The converted-directory files of an in-memory DecoderLM into the existing directory `out`; returns the
    contents of its mhar_config.json."""
    return _write_directory(out, _model_plan(model, dtype), model.config, model.residual, source, max_shard_bytes)


def save_pretrained(model: DecoderLM, dst: str | os.PathLike, source: Optional[dict[str, Any]] = None,
                    dtype: Optional[str] = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    overwrite: bool = False) -> Path:
    """Write an in-memory DecoderLM (e.g. a trained or EMA-swapped model) as a converted directory."""
    with staged_directory(dst, overwrite) as out:
        write_pretrained(model, out, source, dtype, max_shard_bytes)
    return Path(dst)


def write_hf(model: DecoderLM, out: Path, dtype: str, architecture: Optional[str] = None,
             max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, eos_token_id: Optional[int] = None) -> dict[str, Any]:
    """A transformers-loadable Llama / Qwen3 directory's weights and config.json from an in-memory standard-
    residual DecoderLM, into the existing directory `out`; returns the config.json dict (with eos_token_id
    when given)."""
    _require_standard(model.residual, "the model")
    hf = hf_config_from_model(model.config, architecture or default_architecture(model.config))
    hf["dtype"] = dtype
    if eos_token_id is not None:
        hf["eos_token_id"] = eos_token_id
    write_tensors(_model_plan(model, dtype, _hf_name), out, max_shard_bytes)
    _write_json(out / "config.json", hf)
    return hf


def default_architecture(cfg: ModelConfig) -> str:
    """The transformers class a standard-residual model of `cfg` is: Qwen3 with q/k norms, else Llama."""
    return "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"


def _require_standard(residual: ResidualStrategy, where: str) -> None:
    if not residual.is_standard_residual:
        raise ConversionError(
            f"{where}: residual strategy {residual.method_label()} has no transformers equivalent; "
            "only StandardResidual directories can be exported with --export-hf"
        )


# ---------------------------------------------------------------------------------------------- loading
def read_mhar_config(path: str | os.PathLike) -> dict[str, Any]:
    data = _read_json(Path(path) / MHAR_CONFIG)
    if data.get("format") != FORMAT:
        raise ConversionError(f"{path}/{MHAR_CONFIG}: field 'format' = {data.get('format')!r}, expected {FORMAT!r}")
    return data


def _check_config(saved: dict[str, Any], cfg: ModelConfig, where: str) -> None:
    mine = cfg.to_dict()
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, model {mine[k]!r}" for k in _FUNCTIONAL_FIELDS if saved.get(k) != mine[k]]
    if diffs:
        raise ConversionError(f"{where}: model config mismatch in field " + "; ".join(diffs))


def load_weights_into(model: DecoderLM, path: str | os.PathLike, check_config: bool = True) -> dict[str, list[str]]:
    """Copy a converted directory (or a .safetensors file / index) into an existing DecoderLM, in place.

    Every transformer tensor must be present with the model's shape. Residual-strategy tensors must all be
    present too, unless the checkpoint has none at all (e.g. a `--strategy standard` conversion loaded into
    a delta model): the strategy then keeps its own (identity) init. Returns {"loaded", "kept_init"}.
    """
    path = Path(path)
    if check_config and path.is_dir() and (path / MHAR_CONFIG).is_file():
        _check_config(read_mhar_config(path)["model_config"], model.config, str(path / MHAR_CONFIG))
    shapes = expected_shapes(model)
    params = model.state_dict(keep_vars=True)
    with TensorReader(path) as reader:
        names = _names_to_load(reader, shapes)
        for name in names:
            _check_shape(str(path), name, reader.shape(name), shapes[name])
        with torch.no_grad():
            for name in names:
                _copy_into(params[name], reader.get(name), name, path)
    return {"loaded": names, "kept_init": sorted(set(shapes) - set(names))}


def _names_to_load(reader: TensorReader, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    ignorable = {"lm_head.weight"}  # a tied model may be loaded from a checkpoint that also stored the head
    unexpected = [k for k in reader.keys() if k not in shapes and k not in ignorable]
    if unexpected:
        raise ConversionError(f"{reader.path}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all); "
                              "was it converted for another residual strategy or model?")
    has_residual = any(k.startswith("residual.") for k in reader.keys())
    missing = [k for k in shapes if k not in reader and (has_residual or not k.startswith("residual."))]
    if missing:
        raise ConversionError(f"{reader.path}: missing tensor {missing[0]!r} ({len(missing)} in all)")
    return [k for k in shapes if k in reader]


def _copy_into(param: torch.Tensor, value: torch.Tensor, name: str, path: Path) -> None:
    if param.is_meta:
        raise ConversionError(f"cannot load {name!r} from {path}: the model's parameters are on the meta device")
    param.copy_(value)


def load_pretrained(path: str | os.PathLike, device: str | torch.device = "cpu",
                    dtype: torch.dtype | str = torch.float32, backend: Optional[str] = None,
                    allowed: tuple[str, ...] = strategies.ALLOWED_PACKAGES) -> DecoderLM:
    """A DecoderLM in eval mode, built from a converted directory's mhar_config.json and loaded from it.
    The strategy's class must lie in an `allowed` package or be named there exactly."""
    path = Path(path)
    meta = read_mhar_config(path)
    try:
        cfg = ModelConfig.from_dict(meta["model_config"])
    except (KeyError, TypeError, ValueError) as err:
        raise ConversionError(f"{path / MHAR_CONFIG}: bad field 'model_config' ({err})") from err
    residual = strategies.rebuild(meta.get("residual") or strategies.STANDARD, backend=backend, allowed=allowed)
    dtype = _parse_dtype(dtype) if isinstance(dtype, str) else dtype
    return build_from_weights(cfg, residual, path, device=device, dtype=dtype, check_config=False).eval()


def build_from_weights(cfg: ModelConfig, residual: ResidualStrategy, path: str | os.PathLike,
                       device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       check_config: bool = True) -> DecoderLM:
    """A DecoderLM whose weights come from `path`, built without allocating a random init first.

    Every transformer tensor must be in the file (a missing one is an error, so nothing stays
    uninitialised); strategy tensors the file lacks keep the strategy's own (identity) init. At 8B this
    skips ~8e9 random draws and one full-size temporary copy per rank.
    """
    model = unloaded_decoder(cfg, residual, device).to(dtype=dtype)  # .to keeps the tie (same Parameter)
    model.residual.reset_parameters()
    load_weights_into(model, path, check_config=check_config)
    return model


# ---------------------------------------------------------------------------------------------- ours -> HF
def export_hf(src: str | os.PathLike, dst: str | os.PathLike, architecture: Optional[str] = None,
              dtype: Optional[str] = "source", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              overwrite: bool = False) -> Path:
    """Write a transformers-loadable Llama / Qwen3 directory from a StandardResidual converted directory."""
    src, dst = Path(src), Path(dst)
    _check_separate(src, dst)
    meta = read_mhar_config(src)
    residual = strategies.rebuild(meta.get("residual") or strategies.STANDARD)
    _require_standard(residual, str(src))
    cfg = ModelConfig.from_dict(meta["model_config"])
    _check_tokenizer(src, cfg.vocab_size)
    arch = architecture or (meta.get("source") or {}).get("architecture")
    arch = arch or default_architecture(cfg)
    hf = hf_config_from_model(cfg, arch)
    shapes = expected_shapes(_meta_model(cfg, residual))
    cast = _cast(_parse_dtype(dtype))
    with TensorReader(src) as reader:
        names = _names_to_load(reader, shapes)
        for name in names:
            _check_shape(str(src), name, reader.shape(name), shapes[name])
        plan = [(_hf_name(n), reader.nbytes(n), lambda n=n: cast(reader.get(n))) for n in names]
        hf["dtype"] = str(_parse_dtype(dtype) or reader.dtype(names[0])).removeprefix("torch.")
        with staged_directory(dst, overwrite) as out:
            write_tensors(plan, out, max_shard_bytes)
            _write_json(out / "config.json", hf)
            _copy_tokenizer_files(src, out)
    return dst
