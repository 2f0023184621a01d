"""File integrity helpers: content digests, checksum manifests, and staging areas a crash leaves behind.

- `file_sha256` / `content_digests`: sha256 of file contents. Input fingerprints use content, not mtime, so
  touching a file does not re-tokenize a corpus; `content_digests` memoizes digests by (path, size, mtime,
  inode) in a small JSON file so an unchanged corpus is not re-read on every start.
- `write_manifest` / `verify_manifest`: sha256 and size of every file of a prepared dataset, checked once per
  file per process before training reads it (a zero-filled, truncated or bit-flipped chunk is a clear error,
  not silent garbage or litdata's "hung or crashed download").
- `staging_lock` / `is_stale`: a staging file or folder is owned by whoever holds an exclusive `flock` on its
  lock file; one whose lock can be taken belongs to a process that died, and may be removed. flock is released
  by the kernel when a process dies (SIGKILL included) and works across hosts on NFS (emulated with fcntl).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from mhar_lit.errors import UserError

_BLOCK = 8 * 1024 * 1024
MANIFEST_NAME = "checksums.json"
LOCK_NAME = ".lock"
# A staging folder without its lock file is either being created this instant or was left by a crash between
# mkdir and lock: it is treated as stale only once older than this.
UNLOCKED_GRACE_S = 60.0

_verified: set[tuple] = set()  # (path, size, mtime_ns, inode) of files verified in this process


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _stat_key(path: str) -> str:
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to a temp file in the same folder, fsync it and rename it over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to a temp file in the same folder, fsync it and rename it over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def content_digests(paths: list[str], memo_file: Path | None) -> list[str]:
    """sha256 of each file's contents, reusing digests memoized under an unchanged (size, mtime, inode).

    The memo only saves reading: a touched file is re-hashed (and, its content unchanged, gives the same digest).
    """
    memo = {}
    if memo_file is not None and memo_file.is_file():
        with contextlib.suppress(ValueError, OSError):
            memo = json.loads(memo_file.read_text())
    digests, changed = [], False
    for path in paths:
        key = _stat_key(path)
        entry = memo.get(path)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == key):
            entry = [key, file_sha256(path)]
            memo[path], changed = entry, True
        digests.append(entry[1])
    if changed and memo_file is not None:
        with contextlib.suppress(OSError):  # a read-only cache still works, only slower
            memo_file.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(memo_file, memo)
    return digests


# ---------------------------------------------------------------- manifests


def write_manifest(root: Path, files: list[Path]) -> dict:
    """Record sha256 and size of `files` (relative to `root`) in root/checksums.json, atomically."""
    entries = {f.relative_to(root).as_posix(): {"sha256": file_sha256(f), "size": f.stat().st_size} for f in files}
    write_json_atomic(root / MANIFEST_NAME, {"algorithm": "sha256", "files": entries})
    return entries


class CorruptFileError(UserError):
    """A file whose contents do not match its recorded checksum (printed as one line by the CLI)."""


def verify_manifest(root: Path, rebuild_hint: str) -> int:
    """Check every file of root/checksums.json (each at most once per process); return the bytes read.

    Raises CorruptFileError naming the first missing, resized or altered file and `rebuild_hint`.
    """
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    read = 0
    for rel, want in sorted(manifest["files"].items()):
        path = root / rel
        if not path.is_file():
            raise CorruptFileError(f"prepared file {path} is missing. {rebuild_hint}")
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
        if key in _verified:
            continue
        if st.st_size != want["size"]:
            raise CorruptFileError(
                f"prepared file {path} has {st.st_size} bytes, but {want['size']} were written (truncated or "
                f"overwritten). {rebuild_hint}")
        if file_sha256(path) != want["sha256"]:
            raise CorruptFileError(
                f"prepared file {path} does not match its sha256 checksum in {root / MANIFEST_NAME} (its bytes "
                f"changed on disk after preparation). {rebuild_hint}")
        read += st.st_size
        _verified.add(key)
    return read


# ---------------------------------------------------------------- staging areas


def try_lock(path: Path):
    """An open file holding an exclusive flock on `path`, or None if another process holds it (or it is gone)."""
    try:
        f = open(path, "r+b")  # noqa: SIM115 - the caller keeps it open while it owns the lock
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def hold_new_lock(path: Path):
    """Create `path` and hold an exclusive flock on it until the returned file is closed."""
    f = open(path, "w+b")  # noqa: SIM115
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    return f


def remove_stale_staging_dirs(parent: Path, pattern: str) -> list[Path]:
    """Remove folders matching `pattern` in `parent` whose owner died; return them.

    A folder is stale when its lock file (`.lock` inside) can be locked, or when it has no lock file and is
    older than UNLOCKED_GRACE_S. Folders of live processes (their lock held) are left alone.
    """
    removed = []
    for folder in sorted(parent.glob(pattern)) if parent.is_dir() else []:
        if not folder.is_dir():
            continue
        lock_path = folder / LOCK_NAME
        if lock_path.exists():
            lock = try_lock(lock_path)
            if lock is None:
                continue  # a live build
            with lock:
                shutil.rmtree(folder, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                if time.time() - folder.stat().st_mtime < UNLOCKED_GRACE_S:
                    continue
            shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed
