"""Safetensors I/O for checkpoint directories: lazy (sharded) reading, sharded writing, atomic output dirs.

Only safetensors is read or written: no pickle, so a checkpoint cannot execute code when loaded.
A directory holds either `model.safetensors` or `model.safetensors.index.json` plus the shards it names
(the Hugging Face layout, used for our own converted directories too).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mhar_lit.convert.hf_config import ConversionError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as err:  # SafetensorError for corrupt / truncated headers, OSError for unreadable files
        raise ConversionError(f"{path}: not a readable safetensors file ({err})") from err


def _weight_map(path: Path) -> dict[str, Path]:
    """tensor name -> file, for a directory, an index.json or a single .safetensors file."""
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _index_map(path)
        return {name: path for name in _keys_of(path)}
    if (path / INDEX_FILE).is_file():
        return _index_map(path / INDEX_FILE)
    if (path / SINGLE_FILE).is_file():
        return {name: path / SINGLE_FILE for name in _keys_of(path / SINGLE_FILE)}
    raise ConversionError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _keys_of(file: Path) -> list[str]:
    with _open(file) as handle:
        return list(handle.keys())


def _index_map(index_file: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as err:
        raise ConversionError(f"{index_file}: unreadable index ({err})") from err
    files = {name: index_file.parent / shard for name, shard in weight_map.items()}
    for shard in sorted(set(files.values())):
        if not shard.is_file():
            raise ConversionError(f"{index_file}: shard {shard.name} is missing")
        present = set(_keys_of(shard))  # also validates every shard's header up front
        for name in (n for n, f in files.items() if f == shard and n not in present):
            raise ConversionError(f"{shard}: tensor {name!r} listed in the index is missing from the shard")
    return files


class TensorReader:
    """Lazy access to the tensors of a checkpoint: shapes from headers, data loaded one tensor at a time."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.files = _weight_map(self.path)
        self._handles: dict[Path, object] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def keys(self) -> list[str]:
        return list(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str):
        if name not in self.files:
            raise ConversionError(f"{self.path}: missing tensor {name!r}")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(_open(file))
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._handle(name).get_slice(name).get_dtype()
        if code not in _DTYPES:
            raise ConversionError(f"{self.files[name]}: tensor {name!r} has unsupported dtype {code}")
        return _DTYPES[code]

    def nbytes(self, name: str) -> int:
        numel = 1
        for size in self.shape(name):
            numel *= size
        return numel * self.dtype(name).itemsize

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle(name).get_tensor(name)
        except ConversionError:
            raise
        except Exception as err:
            raise ConversionError(f"{self.files[name]}: cannot read tensor {name!r} ({err})") from err

    def metadata(self) -> dict[str, str]:
        first = next(iter(self.files.values()), None)
        if first is None:
            return {}
        with _open(first) as handle:
            return handle.metadata() or {}


# A planned output tensor: its name, its size in bytes, and how to produce it when its shard is written.
Planned = tuple[str, int, Callable[[], torch.Tensor]]


def _shards(plan: list[Planned], max_bytes: int) -> list[list[Planned]]:
    shards: list[list[Planned]] = [[]]
    size = 0
    for item in plan:
        if shards[-1] and size + item[1] > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[1]
    return shards


def write_tensors(plan: list[Planned], out_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                  metadata: dict[str, str] | None = None) -> list[str]:
    """Write `plan` as model.safetensors, or as HF-style shards plus an index when it exceeds one shard.

    Tensors are produced shard by shard, so peak memory is about one shard, not the whole model.
    """
    shards = _shards(plan, max_shard_bytes)
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        save_file(_materialise(shards[0]), str(out_dir / SINGLE_FILE), metadata=meta)
        return [SINGLE_FILE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(_materialise(shard), str(out_dir / name), metadata=meta)
        weight_map.update({tensor: name for tensor, _, _ in shard})
        names.append(name)
    total = sum(nbytes for _, nbytes, _ in plan)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names + [INDEX_FILE]


def _materialise(shard: list[Planned]) -> dict[str, torch.Tensor]:
    # clone(): safetensors refuses tensors that share storage (tied weights, views of one buffer).
    return {name: make().detach().to("cpu").contiguous().clone() for name, _, make in shard}


def check_output(target: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse, before anything is written, an output that is not a directory, is not empty (unless
    `overwrite`), or whose nearest existing parent is not a writable directory. Returns the absolute path."""
    target = Path(target).absolute()
    if target.exists() and not target.is_dir():
        raise ConversionError(f"output {target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ConversionError(f"output directory {target} is not empty; pass --overwrite to replace it")
    from mhar_lit.paths import cannot_create_files_in, nearest_existing

    parent = Path(nearest_existing(target.parent))
    if not parent.is_dir():
        raise ConversionError(f"cannot create output directory {target}: {parent} is not a directory")
    if cannot_create_files_in(parent):
        raise ConversionError(f"cannot create output directory {target}: {parent} is not writable")
    return target


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `target` and rename it into place only if the block succeeds.

    A failed conversion therefore never leaves a half-written target (nor the parents created for it), and
    an existing non-empty target is refused up front unless `overwrite` (it is then replaced only once the
    new directory is complete). An OS error while writing becomes a ConversionError naming `target`.
    """
    target = check_output(target, overwrite)
    created = [p for p in target.parents if not p.exists()]  # deepest first, removed again on failure
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    except OSError as err:  # e.g. a read-only file system or an immutable directory
        _remove_empty(created)
        raise ConversionError(f"cannot create output directory {target}: {err.strerror or err}") from err
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it 0700; the result should look like a normal mkdir
        yield staging
        _swap_into_place(staging, target)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(created)
        if isinstance(err, (OSError, SafetensorError)):  # disk full, permissions, ...: name the output, not staging
            detail = str(err).replace(str(staging), str(target))
            raise ConversionError(f"cannot write output directory {target}: {detail}") from err
        raise


def _remove_empty(dirs: list[Path]) -> None:
    for path in dirs:
        try:
            path.rmdir()
        except OSError:
            break


def _swap_into_place(staging: Path, target: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for file in staging.iterdir():  # safetensors writes 0600 files; give them the usual permissions
        if file.is_file():
            os.chmod(file, 0o666 & ~umask)
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        os.rename(target, old)
    try:
        os.rename(staging, target)
    except OSError:
        if old is not None:  # put the previous output back rather than leave it under a hidden name
            os.rename(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
