"""`AtomicCheckpointIO`: checkpoint files that are either the old or the new one, and checked when loaded.

Lightning's `TorchCheckpointIO` serializes into memory and then writes the destination in place (through an
fsspec transaction whose temp file lies in TMPDIR, often another file system, so the final move is a copy): a
crash or a full disk mid-write leaves a truncated `last.ckpt` where the previous good one was. This plugin:

- writes `torch.save` output to `.<name>.tmp-<pid>-<ns>` in the destination's own folder (same file system, so
  the rename is atomic), hashing the bytes as they stream out, fsyncs it, and `os.replace`s it over the
  destination, then fsyncs the folder;
- records the sha256 in a sidecar `<name>.sha256` in `sha256sum` format (`sha256sum -c last.ckpt.sha256`
  checks it by hand). A sidecar rather than a field inside the checkpoint: a file cannot hold the hash of its
  own bytes, and hashing the tensors inside the dict instead would miss damage to the zip structure and cost
  a second pass. The pair is kept consistent across a crash at any point: before the replace the sidecar lists
  both the new and the old digest, after it only the new one (each sidecar write is itself atomic);
- verifies the sidecar when Lightning loads a checkpoint (`fit(ckpt_path=...)`, validate, test) with
  mhar_lit.checkpoint.verify_checkpoint, the rule every command applies: a mismatch is an error naming the
  file, and so is a checkpoint without a sidecar (`sha256sum FILE > FILE.sha256` records one for a file you
  trust): unchecked bytes could resume a corrupted run;
- removes temp files of interrupted saves (files named `.*.tmp-*` whose lock is free: every temp file is
  held under an exclusive flock by its writer) the first time it saves or loads in a folder in a process.

Remote paths (s3://, ...) fall back to Lightning's behaviour. `LanguageModel.load_from_checkpoint` reads files
without a CheckpointIO and is not verified by this plugin (mhar_lit.checkpoint.read_checkpoint is).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

from mhar_lit.checkpoint import (CorruptCheckpointError, read_digests, sidecar_path,  # noqa: F401 (re-exported)
                                 verify_checkpoint)
from mhar_lit.data.integrity import file_sha256, hold_new_lock, try_lock

log = logging.getLogger(__name__)

TEMP_GLOB = ".*.tmp-*"


class _HashingWriter:
    """File-like sink for torch.save that hashes the bytes it passes on (torch writes the zip sequentially)."""

    def __init__(self, f):
        self._f = f
        self._hash = hashlib.sha256()

    def write(self, data) -> int:
        self._hash.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _temp_name(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_locked(dest: Path, write, before_replace=None) -> None:
    """Write a temp file next to `dest` under a lock with `write(file)`, fsync it, call `before_replace()`, and
    rename it over `dest`. A failure at any point removes the temp file and leaves `dest` as it was."""
    tmp = _temp_name(dest)
    f = hold_new_lock(tmp)
    try:
        write(f)
        f.flush()
        os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        f.close()


def _write_sidecar(dest: Path, digests: list[str]) -> None:
    lines = "".join(f"{d}  {dest.name}\n" for d in digests)
    _replace_locked(sidecar_path(dest), lambda f: f.write(lines.encode()))


def remove_stale_temp_files(folder: Path) -> list[Path]:
    """Remove temp files of interrupted saves in `folder` (those whose writer's lock is free)."""
    removed = []
    for tmp in sorted(folder.glob(TEMP_GLOB)) if folder.is_dir() else []:
        lock = try_lock(tmp) if tmp.is_file() else None
        if lock is None:
            continue  # a save in progress (or not a file)
        with lock:
            tmp.unlink(missing_ok=True)
        removed.append(tmp)
        log.warning("removed %s, left by an interrupted checkpoint save", tmp)
    return removed


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO with atomic same-folder writes, sha256 sidecars and verified loads (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._cleaned: set[str] = set()

    def _clean_once(self, folder: Path) -> None:
        key = os.path.realpath(folder)
        if key not in self._cleaned:
            self._cleaned.add(key)
            remove_stale_temp_files(folder)

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        import torch

        dest = Path(os.path.realpath(path))  # through a link: replace its target, as open() would write it
        dest.parent.mkdir(parents=True, exist_ok=True)
        self._clean_once(dest.parent)
        old = read_digests(dest) if dest.exists() else []
        if old is None:  # a file saved without a sidecar: keep it loadable if this save is interrupted
            old = [file_sha256(dest)]
        new = []

        def write(f):
            sink = _HashingWriter(f)
            torch.save(checkpoint, sink)
            new.append(sink.hexdigest())

        def accept_new_and_old():  # a crash before or after the replace leaves a file the sidecar accepts
            _write_sidecar(dest, new + [d for d in old if d not in new])

        _replace_locked(dest, write, accept_new_and_old)
        _write_sidecar(dest, new)
        _fsync_dir(dest.parent)

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage, weights_only: bool | None = None):
        if _is_local_file_protocol(path) and os.path.isfile(path):
            self._clean_once(Path(os.path.realpath(path)).parent)
            verify_checkpoint(path)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        # a link (save_last="link") has no sidecar of its own: its target's stays with the target
        local_file = _is_local_file_protocol(path) and not os.path.islink(path)
        sidecar = sidecar_path(path) if local_file else None
        super().remove_checkpoint(path)
        if sidecar is not None:
            sidecar.unlink(missing_ok=True)

