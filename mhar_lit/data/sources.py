"""Finding input files and reading documents out of them.

Inputs are local paths: files, directories (searched recursively) or glob patterns. Supported
files and what one document is in each:
- `.txt`, `.md`, `.py`: the whole file is one document (the embedded corpus is `.py` files).
- `.jsonl`: one JSON object per line; the document is its `text_field` value.
- `.parquet`: one row per document, from the `text_field` column (the anneal corpus layout).

An input may instead be an already optimized litdata dataset: a directory holding `index.json`
(used as the training set), a directory with `train/index.json` (and optionally `val/index.json`,
the layout `prepare` writes), or a remote URI such as `s3://bucket/prefix`, which cannot be checked
offline and is therefore taken to be an optimized dataset.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mhar_lit.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".py")
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")
GLOB_CHARS = frozenset("*?[")
_UTF8_BLOCK = 16 * 1024 * 1024


class InputError(UserError):
    """An input path, pattern or file that cannot be used, with the reason in the message (a ValueError, printed
    as one line by the CLI)."""


@dataclass(frozen=True)
class InputFile:
    """One raw input file (the preparation cache fingerprints its content, see prepare.input_digests)."""

    path: str
    size: int
    mtime_ns: int

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> InputFile:
        st = os.stat(path)
        return cls(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)

    @property
    def suffix(self) -> str:
        return Path(self.path).suffix.lower()


@dataclass(frozen=True)
class OptimizedInput:
    """An already optimized litdata dataset: `train` (and maybe `val`) are dirs or URIs."""

    train: str
    val: str | None = None


def is_remote(spec: str) -> bool:
    return "://" in spec and not spec.startswith("file://")


def find_optimized(spec: str) -> OptimizedInput | None:
    """The optimized dataset `spec` names, or None if it is raw input."""
    if is_remote(spec):
        return OptimizedInput(train=spec.rstrip("/"))
    path = Path(spec)
    if (path / "index.json").is_file():
        return OptimizedInput(train=str(path.resolve()))
    if (path / "train" / "index.json").is_file():
        val = path / "val"
        return OptimizedInput(
            train=str((path / "train").resolve()),
            val=str(val.resolve()) if (val / "index.json").is_file() else None,
        )
    return None


def _check_supported(path: Path) -> None:
    if path.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise InputError(f"unsupported input file {path}: expected one of {', '.join(SUPPORTED_SUFFIXES)}")


def _files_in_directory(directory: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # skip .git, .cache, ...
        for name in filenames:
            if not name.startswith(".") and Path(name).suffix.lower() in SUPPORTED_SUFFIXES:
                files.append(Path(dirpath) / name)
    if not files:
        raise InputError(f"directory {directory} holds no input files ({', '.join(SUPPORTED_SUFFIXES)})")
    return sorted(files, key=lambda p: p.relative_to(directory).as_posix())


def _expand_one(spec: str) -> list[Path]:
    if GLOB_CHARS & set(spec):
        matches = sorted(Path(m) for m in glob.glob(spec, recursive=True))
        files = [m for m in matches if m.is_file()]
        if not files:
            raise InputError(f"glob pattern {spec!r} matched no files")
        for f in files:
            _check_supported(f)
        return files
    path = Path(spec)
    if not path.exists():
        raise InputError(f"input path does not exist: {spec}")
    if path.is_dir():
        return _files_in_directory(path)
    _check_supported(path)
    return [path]


def expand_inputs(specs: list[str]) -> list[InputFile]:
    """The raw input files `specs` name, each once, in input order then sorted path order."""
    if not specs:
        raise InputError("no inputs given")
    seen, files = set(), []
    for spec in specs:
        for path in _expand_one(str(spec)):
            entry = InputFile.from_path(path)
            if entry.path not in seen:
                seen.add(entry.path)
                files.append(entry)
    return files


def is_valid_utf8(path: str) -> bool:
    """Whether the whole file decodes as UTF-8, read in blocks so huge files stay cheap."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            while block := f.read(_UTF8_BLOCK):
                decoder.decode(block)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def check_parquet_field(path: str, text_field: str) -> None:
    import pyarrow.parquet as pq

    names = pq.ParquetFile(path).schema_arrow.names
    if text_field not in names:
        raise InputError(f"parquet file {path} has no column {text_field!r} (columns: {names})")


def _iter_text_file(path: str) -> Iterator[str]:
    yield Path(path).read_bytes().decode("utf-8")


def _iter_jsonl(path: str, text_field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{line_no}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise InputError(f"{path}:{line_no}: no field {text_field!r} in this record")
            text = record[text_field]
            if text is not None and not isinstance(text, str):
                raise _not_a_string(path, f"line {line_no}", text_field, text)
            yield text


def _not_a_string(path: str, where: str, text_field: str, value) -> InputError:
    return InputError(f"{path}: {where}: field {text_field!r} is {type(value).__name__} ({value!r:.40}), not a string; "
                      "every document's text must be a string (null or empty documents are skipped)")


def _iter_parquet(path: str, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise _not_a_string(path, f"row {row}", text_field, text)
            row += 1
            yield text


def iter_documents(path: str, text_field: str = "text") -> Iterator[str]:
    """The non-empty documents of one input file, in file order."""
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        docs = _iter_jsonl(path, text_field)
    elif suffix == ".parquet":
        docs = _iter_parquet(path, text_field)
    else:
        docs = _iter_text_file(path)
    return (d for d in docs if d)  # None and "" carry no tokens and no document boundary


# A fixed salt keeps the split stable across runs and machines (no dependence on Python's hash seed).
_SPLIT_SALT = b"mhar_lit-split-v1:"


def is_validation(text: str, val_fraction: float) -> bool:
    """Whether a document belongs to the held-out validation split.

    Decided by a hash of the document's content, so it is deterministic, independent of input
    order and worker count, and identical documents always land in the same split (no leakage).
    """
    if val_fraction <= 0.0:
        return False
    digest = hashlib.blake2b(_SPLIT_SALT + text.encode("utf-8", errors="replace"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < val_fraction * 2.0**64
