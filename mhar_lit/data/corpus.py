"""The embedded default corpus: the Python standard library's own source files.

Every Python install ships a few megabytes of real, code-heavy text (about 12 MB of `.py` in
CPython 3.11 outside its test suites), so smoke runs, CI and the tutorial need no download and
no network. Each file is one document.

Choices, all deterministic so the same interpreter always gives the same corpus:
- Files are walked in sorted path order (sorted relative POSIX paths, not filesystem order).
- Test suites are skipped (`test/`, `tests/`, `idle_test/`): they are large, repetitive, and hold
  deliberately odd files (non-UTF-8 encodings, huge data literals) that add nothing as training
  text. Installed third-party packages (`site-packages/`, `dist-packages/`) are skipped because
  they are not the standard library and differ between machines.
- A byte cap keeps the corpus small for quick runs: files are taken in order while the running
  total stays within `max_bytes`; the first file that would overflow it ends the corpus, so the
  corpus is always a prefix of the sorted list.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

# Directories whose contents are never part of the embedded corpus (see the module docstring).
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
NON_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

DEFAULT_MAX_CORPUS_BYTES = 32 * 1024 * 1024


def stdlib_root() -> Path:
    """The directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _skipped(rel_dir_parts: tuple[str, ...], skip_tests: bool) -> bool:
    names = set(rel_dir_parts)
    if names & NON_STDLIB_DIRS:
        return True
    return skip_tests and bool(names & TEST_DIRS)


def _all_stdlib_sources(root: Path, skip_tests: bool) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_parts = Path(dirpath).relative_to(root).parts
        if _skipped(rel_parts, skip_tests):
            dirnames[:] = []  # do not descend into a skipped tree at all
            continue
        found.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    # Sort by the relative POSIX path so the order is independent of os.walk's order.
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus_files(
    max_bytes: int | None = DEFAULT_MAX_CORPUS_BYTES,
    skip_tests: bool = True,
    root: str | os.PathLike | None = None,
) -> list[Path]:
    """The standard-library `.py` files of the embedded corpus, in deterministic order.

    `max_bytes=None` takes every file. Raises if nothing is found (a stripped interpreter).
    """
    root = Path(root) if root is not None else stdlib_root()
    files = _all_stdlib_sources(root, skip_tests)
    if not files:
        raise FileNotFoundError(f"no .py files found under the standard library directory {root}")
    if max_bytes is None:
        return files
    if max_bytes <= 0:
        raise ValueError(f"max_corpus_bytes must be positive or None, got {max_bytes}")
    chosen, total = [], 0
    for path in files:
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    if not chosen:
        raise ValueError(
            f"max_corpus_bytes={max_bytes} is smaller than the first corpus file "
            f"({files[0]}, {files[0].stat().st_size} bytes)"
        )
    return chosen
