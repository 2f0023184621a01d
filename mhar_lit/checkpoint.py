"""The one reader of mhar_lit's Lightning checkpoints: the model, the data settings, the tokenizer and EOS ids,
after the file's sha256 sidecar has been checked.

    contents = read_checkpoint("runs/.../last.ckpt")          # verified; refused when altered or unrecorded
    contents.model, contents.data_settings, contents.tokenizer, contents.eos_ids

`generate`, `export`, `probe`, the lm-eval adapter and `perplexity` read through `read_checkpoint`; a resumed
`fit` verifies through the same `verify_checkpoint` (AtomicCheckpointIO.load_checkpoint, and the CLI before
the MLflow run opens). The rules:

- the sidecar `<file>.sha256` (written by AtomicCheckpointIO, `sha256sum` format) must list the file's digest:
  a mismatch is an error, always;
- a file without a sidecar is refused too, unless the caller allows it (`--allow_unverified`): a file that
  cannot be checked could be any bytes. `sha256sum FILE > FILE.sha256` records the digest of a file you trust;
- a truncated file, another kind of file, or pickled objects (unless `trust_pickle`) are one-line errors
  naming the file, before torch reads it.

Nothing here imports Lightning, so the commands that only read a checkpoint start quickly.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from mhar_lit.errors import UserError, UserFileNotFoundError

SIDECAR_SUFFIX = ".sha256"


class CorruptCheckpointError(UserError):
    """A checkpoint whose bytes do not match the sha256 recorded when it was saved."""


class UnverifiedCheckpointError(UserError):
    """A checkpoint with no sha256 sidecar, read by a command that was not told to accept that."""


# ----------------------------------------------------------------------------- the sha256 sidecar
def sidecar_path(path: str | os.PathLike) -> Path:
    """The checksum file of a checkpoint (of its target, when the checkpoint is a link such as last.ckpt)."""
    real = Path(os.path.realpath(path))
    return real.with_name(real.name + SIDECAR_SUFFIX)


def read_digests(path: str | os.PathLike) -> list[str] | None:
    """The digests a checkpoint's sidecar accepts, or None if it has no sidecar."""
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        return None
    return [line.split()[0] for line in sidecar.read_text().splitlines() if line.strip()]


def record_checksum(path: str | os.PathLike) -> Path:
    """Write the sidecar of an existing checkpoint file (what `sha256sum FILE > FILE.sha256` writes)."""
    from mhar_lit.data.integrity import file_sha256, write_text_atomic

    sidecar = sidecar_path(path)
    write_text_atomic(sidecar, f"{file_sha256(path)}  {Path(os.path.realpath(path)).name}\n")
    return sidecar


def verify_checkpoint(path: str | os.PathLike, allow_unverified: bool = False) -> bool:
    """Check a checkpoint file against its sidecar: True when it matches; False for a file without a sidecar
    when `allow_unverified`; otherwise an error naming the file and what to do."""
    from mhar_lit.data.integrity import file_sha256

    digests = read_digests(path)
    if digests is None:
        if allow_unverified:
            return False
        raise UnverifiedCheckpointError(
            f"checkpoint {path} has no checksum file {sidecar_path(path).name}, so its bytes cannot be checked: if "
            f"you trust the file, record its checksum with `sha256sum {path} > {sidecar_path(path)}` (or pass "
            "--allow_unverified to the command reading it)")
    if file_sha256(path) not in digests:
        raise CorruptCheckpointError(
            f"checkpoint {path} does not match the sha256 recorded in {sidecar_path(path)} when it was saved: its "
            "bytes changed since (disk, copy or transfer damage). Use another checkpoint; if you are sure the "
            f"file is good, record its checksum again with `sha256sum {path} > {sidecar_path(path)}`")
    return True


def check_checkpoint_file(path: str | os.PathLike) -> None:
    """Refuse a missing, truncated or foreign checkpoint file with its name, before anything loads it.

    torch.save writes a zip archive whose directory is at its end, so a truncated copy or another kind of file
    fails `zipfile.is_zipfile` (torch's own errors name neither the file nor the cause, or advise
    weights_only=False for a text file)."""
    path = str(path)
    if os.path.isdir(path):
        raise UserError(f"cannot read checkpoint {path}: it is a directory (a sharded FSDP checkpoint?), not a "
                        "single .ckpt file")
    if not os.path.isfile(path):
        raise UserFileNotFoundError(f"checkpoint not found: {path}")
    if not zipfile.is_zipfile(path):
        raise UserError(f"cannot read checkpoint {path}: not a complete torch checkpoint (no readable zip archive: "
                        "truncated, or another kind of file)")


def load_checkpoint_dict(path: str | os.PathLike, trust_pickle: bool = False, mmap: bool = True) -> dict[str, Any]:
    """torch.load of a checked file, weights_only unless `trust_pickle`; torch's errors become one line."""
    path = str(path)
    check_checkpoint_file(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=not trust_pickle, mmap=mmap)
    except pickle.UnpicklingError as err:
        if not trust_pickle:  # a complete archive whose pickle holds objects weights_only refuses
            raise UserError(f"{path} contains pickled Python objects and was not loaded (weights_only); pass "
                            "--trust_checkpoint (trust_pickle=True) only if you created this file") from err
        raise UserError(f"cannot read checkpoint {path}: {type(err).__name__}: {err}") from err
    except Exception as err:  # a zip that is not a torch file, a damaged member: torch's errors name neither
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise UserError(f"cannot read checkpoint {path}: {type(err).__name__}: {first}") from err
    saved = checkpoint.get("mhar_lit") if isinstance(checkpoint, dict) else None
    if not isinstance(saved, dict) or not {"residual", "model_config"} <= set(saved) or "state_dict" not in checkpoint:
        raise UserError(f"{path} was not written by mhar_lit (no 'mhar_lit' section with the model and strategy)")
    return checkpoint


# ----------------------------------------------------------------------------- the tokenizer of a run
def tokenizer_spec(data_settings: dict[str, Any], override: Optional[str] = None,
                   eos: Optional[str | int] = None, where: str = "the checkpoint") -> tuple[str, Optional[str | int]]:
    """(tokenizer spec, eos) of a run: `override` ('bytes' or a tokenizer.json), else the datamodule's setting;
    a `bpe:<vocab>` setting becomes the path of the tokenizer.json its run trained and cached."""
    from mhar_lit.data.tokenizer import cached_bpe_path

    if override is not None:
        return override, eos if eos is not None or override == "bytes" else data_settings.get("eos")
    spec = data_settings.get("tokenizer")
    if not spec:
        raise UserError(f"{where} does not record its tokenizer (no datamodule settings saved with it): pass "
                        "--tokenizer bytes or the path of the tokenizer.json the model was trained with")
    spec, eos = str(spec), eos if eos is not None else data_settings.get("eos")
    if spec.startswith("bpe:"):
        try:
            spec = str(cached_bpe_path(spec, data_settings.get("cache_dir")))
        except FileNotFoundError as err:
            raise UserFileNotFoundError(f"{where}: {err}: pass --tokenizer PATH/tokenizer.json") from None
    return spec, eos


def build_tokenizer(spec: str, eos: Optional[str | int], where: str):
    """The tokenizer of a spec from `tokenizer_spec`, its errors naming where the spec came from."""
    from mhar_lit.data.tokenizer import load_tokenizer

    if spec != "bytes" and not Path(spec).is_file():
        raise UserFileNotFoundError(f"tokenizer {spec!r} ({where}) not found: pass --tokenizer bytes or the path of "
                                    "the tokenizer.json the model was trained with")
    try:
        return load_tokenizer(spec, eos=None if spec == "bytes" else eos)
    except ValueError as err:
        raise UserError(f"tokenizer {spec!r} ({where}): {err}") from None


# ----------------------------------------------------------------------------- the reader
@dataclass
class CheckpointContents:
    """What a command needs from a checkpoint. `tokenizer` is None when it was not asked for."""

    path: str
    model: Any  # DecoderLM in eval mode, float32
    data_settings: dict[str, Any]
    stored_dtype: str  # the dtype the weights were saved in ("bfloat16" for a bf16-true run)
    verified: bool
    tokenizer: Any = None
    tokenizer_source: tuple[str, Optional[str | int]] = ("", None)
    eos_ids: tuple[int, ...] = field(default_factory=tuple)


def read_checkpoint(path: str | os.PathLike, tokenizer: Optional[str] = None, eos: Optional[str | int] = None,
                    trust_pickle: bool = False, allowed: Optional[tuple[str, ...]] = None,
                    allow_unverified: bool = False, with_tokenizer: bool = True) -> CheckpointContents:
    """Verify (see the module docstring), load once, and rebuild the model, its data settings and tokenizer.

    tokenizer / eos override the run's ('bytes' or a tokenizer.json). `allowed`: the packages a strategy class
    may come from (ResidualStrategy.from_config; default mhar_lit.residual's)."""
    path = str(path)
    check_checkpoint_file(path)
    verified = verify_checkpoint(path, allow_unverified)
    checkpoint = load_checkpoint_dict(path, trust_pickle)
    model = _model(checkpoint, allowed)
    settings = checkpoint.get("datamodule_hyper_parameters") or {}
    settings = dict(settings) if isinstance(settings, dict) else {}
    stored = next((t.dtype for t in checkpoint["state_dict"].values() if t.is_floating_point()), torch.float32)
    contents = CheckpointContents(path, model, settings, str(stored).removeprefix("torch."), verified)
    if with_tokenizer:
        contents.tokenizer_source = tokenizer_spec(settings, tokenizer, eos, f"the checkpoint {path}")
        where = "--tokenizer" if tokenizer else f"recorded in {path}"
        contents.tokenizer = build_tokenizer(*contents.tokenizer_source, where)
        check_vocabulary(contents.tokenizer, model)
        contents.eos_ids = (contents.tokenizer.eos_id,)
    return contents


def _model(checkpoint: dict[str, Any], allowed: Optional[tuple[str, ...]]):
    from mhar_lit.config import ModelConfig
    from mhar_lit.models.decoder import unloaded_decoder
    from mhar_lit.residual.base import ALLOWED_PACKAGES, ResidualStrategy

    saved = checkpoint["mhar_lit"]
    strategy = ResidualStrategy.from_config(saved["residual"], allowed or ALLOWED_PACKAGES)
    # fp32 storage without a random init: every tensor is loaded next (strictly), and drawing ~1e9 normals
    # first would cost seconds at 1B
    model = unloaded_decoder(ModelConfig.from_dict(saved["model_config"]), strategy)
    state = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(state)
    return model.eval()


def check_vocabulary(tokenizer: Any, model: Any) -> None:
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} token ids but the model's vocab_size is "
                        f"{model.config.vocab_size}: pass the model's own tokenizer")


def model_from_checkpoint(path: str | os.PathLike, trust_pickle: bool = False,
                          allowed: Optional[tuple[str, ...]] = None):
    """The DecoderLM (config, strategy, weights) of an mhar_lit checkpoint, in eval mode: the library call.

    A sidecar that does not match is refused; a file without one loads (the commands refuse it unless told
    otherwise). Loads with weights_only=True unless `trust_pickle` (only for files you created yourself)."""
    return read_checkpoint(path, trust_pickle=trust_pickle, allowed=allowed, allow_unverified=True,
                           with_tokenizer=False).model
