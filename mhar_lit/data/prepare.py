"""Pre-tokenize raw text into litdata token chunks, cached by a fingerprint of everything that matters.

Layout of one prepared dataset (SPEC H.1: documents encoded without special tokens, each followed
by EOS, packed into one contiguous token stream with no padding):

    <cache_dir>/tokens-<fingerprint>/
        train/   index.json + chunk-*.bin   (litdata, TokensLoader, int32 tokens)
        val/     the same for the held-out documents (absent when val_fraction == 0 or none fell there)
        meta.json                           (inputs, settings, token counts, skipped files)

The fingerprint covers the input files (path, size, mtime), the tokenizer, and the split and
chunking settings, so a matching cache is reused and any change rebuilds it. The build happens in a
hidden temp directory that is renamed into place only once complete: a crash or a bad input never
leaves a half-written dataset that a later run would trust.

Within one litdata worker the token stream is contiguous across documents and files; chunks hold
whole pieces of at most `chunk_tokens` tokens, and the streaming reader drops each chunk's last
`len(chunk) % (seq_len + 1)` tokens (blocks never span chunks), a loss below seq_len+1 per chunk.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mhar_lit.data.corpus import DEFAULT_MAX_CORPUS_BYTES, stdlib_corpus_files
from mhar_lit.data.sources import (
    TEXT_SUFFIXES,
    InputError,
    InputFile,
    check_parquet_field,
    expand_inputs,
    find_optimized,
    is_valid_utf8,
    is_validation,
    iter_documents,
)
from mhar_lit.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bump when the on-disk layout or the tokenization recipe changes, to invalidate old caches.
FORMAT_VERSION = 1
DEFAULT_CHUNK_TOKENS = 1 << 22  # 4M tokens = 16 MiB of int32 per chunk file
MAX_PIECE_TOKENS = 1 << 16  # items handed to litdata; small enough to pack chunks densely
ENCODE_BATCH_DOCS = 64


@dataclass(frozen=True)
class PreparedData:
    """Where the token chunks are. `val_dir` is None when there is no validation split."""

    train_dir: str
    val_dir: str | None
    meta: dict = field(default_factory=dict)


# ---------------------------------------------------------------- worker side (runs in litdata processes)


def _split_into_pieces(stream: Iterator[np.ndarray], piece_tokens: int) -> Iterator[np.ndarray]:
    """Re-cut a stream of token arrays into consecutive pieces of exactly `piece_tokens` (last may be short)."""
    parts, buffered = [], 0
    for arr in stream:
        parts.append(arr)
        buffered += len(arr)
        if buffered < piece_tokens:
            continue
        joined = np.concatenate(parts)
        cut = len(joined) - len(joined) % piece_tokens
        yield from np.split(joined[:cut], cut // piece_tokens)
        parts, buffered = [joined[cut:]], len(joined) - cut
    if buffered:
        yield np.concatenate(parts)


def _batched(docs: Iterator[str], size: int) -> Iterator[list[str]]:
    batch = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _document_tokens(path: str, tokenizer: Tokenizer, text_field: str, want_val: bool, val_fraction: float):
    """Token arrays (document ids + EOS) of one file's documents that belong to the requested split."""
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    docs = (d for d in iter_documents(path, text_field) if is_validation(d, val_fraction) == want_val)
    for batch in _batched(docs, ENCODE_BATCH_DOCS):
        for ids in tokenizer.encode_batch(batch):
            yield np.concatenate([ids.astype(np.int32, copy=False), eos])


def tokenize_file(
    item: InputFile,
    *,
    tokenizer: Tokenizer,
    text_field: str,
    want_val: bool,
    val_fraction: float,
    piece_tokens: int,
    error_dir: str,
):
    """litdata `fn`: yield one file's split as int32 tensors of at most `piece_tokens` tokens.

    Errors are written to `error_dir` instead of raised: litdata's own error path kills the worker
    but leaves its helper processes orphaned and buries the message in a traceback string. The main
    process re-raises the first recorded error once optimize returns; later files are skipped.
    """
    import torch

    if any(Path(error_dir).iterdir()):
        return  # another file already failed: the build will be discarded anyway
    try:
        stream = _document_tokens(item.path, tokenizer, text_field, want_val, val_fraction)
        for piece in _split_into_pieces(stream, piece_tokens):
            yield torch.from_numpy(np.ascontiguousarray(piece))
    except Exception as e:
        message = str(e) if isinstance(e, InputError) else f"{item.path}: {type(e).__name__}: {e}"
        (Path(error_dir) / f"{os.getpid()}-{time.monotonic_ns()}.txt").write_text(message)


def _raise_recorded_error(error_dir: Path) -> None:
    errors = sorted(error_dir.iterdir())
    if errors:
        raise InputError(errors[0].read_text())


# ---------------------------------------------------------------- main-process side


def _input_files(data: list[str] | None, max_corpus_bytes: int | None) -> list[InputFile]:
    if data is None:
        return [InputFile.from_path(p) for p in stdlib_corpus_files(max_corpus_bytes)]
    return expand_inputs(data)


def _fingerprint(files: list[InputFile], tokenizer: Tokenizer, settings: dict) -> str:
    payload = {
        "format": FORMAT_VERSION,
        "files": [(f.path, f.size, f.mtime_ns) for f in files],
        "tokenizer": tokenizer.fingerprint,
        **settings,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def _validate_files(files: list[InputFile], text_field: str, strict: bool) -> tuple[list[InputFile], list[str]]:
    """Drop (or, if strict, reject) files that are not valid UTF-8; check parquet columns."""
    kept, skipped = [], []
    for f in files:
        if f.suffix == ".parquet":
            check_parquet_field(f.path, text_field)  # Arrow strings are UTF-8 by construction
        elif f.suffix in TEXT_SUFFIXES + (".jsonl",) and not is_valid_utf8(f.path):
            if strict:
                raise InputError(f"input file is not valid UTF-8: {f.path} (strict=True)")
            skipped.append(f.path)
            continue
        kept.append(f)
    if skipped:
        shown = ", ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else "")
        log.warning("skipped %d input file(s) that are not valid UTF-8: %s", len(skipped), shown)
    return kept, skipped


@contextlib.contextmanager
def _private_litdata_scratch(root: Path):
    """Point litdata's scratch folders into our temp dir.

    litdata wipes its global scratch folders (default /tmp/chunks, /tmp/data) at the start of every
    optimize call, which would break another preparation running concurrently on the machine.
    """
    keys = ("DATA_OPTIMIZER_CACHE_FOLDER", "DATA_OPTIMIZER_DATA_CACHE_FOLDER")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ[keys[0]], os.environ[keys[1]] = str(root / "scratch-chunks"), str(root / "scratch-data")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start_method() -> str:
    # fork starts workers in milliseconds and, unlike spawn, does not require the calling script to
    # have an `if __name__ == "__main__":` guard. The workers only tokenize on the CPU, so fork's
    # usual hazards (CUDA in the child) do not apply. Platforms without fork use spawn.
    import multiprocessing as mp

    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def _optimize_split(files, out_dir: Path, tokenizer, text_field, want_val, val_fraction, chunk_tokens, num_workers):
    from litdata import TokensLoader, optimize

    error_dir = out_dir.parent / f"errors-{out_dir.name}"
    error_dir.mkdir()

    fn = functools.partial(
        tokenize_file,
        tokenizer=tokenizer,
        text_field=text_field,
        want_val=want_val,
        val_fraction=val_fraction,
        piece_tokens=min(MAX_PIECE_TOKENS, chunk_tokens),
        error_dir=str(error_dir),
    )
    optimize(
        fn=fn,
        inputs=files,
        output_dir=str(out_dir),
        chunk_size=chunk_tokens,  # counted in tokens for TokensLoader
        item_loader=TokensLoader(),
        num_workers=min(num_workers, len(files)),
        # Static, ordered assignment of files to workers: the same inputs give the same chunks.
        keep_data_ordered=True,
        reorder_files=False,
        mode="overwrite",
        start_method=_start_method(),
    )
    _raise_recorded_error(error_dir)
    error_dir.rmdir()


def _split_stats(split_dir: Path) -> dict:
    index_file = split_dir / "index.json"
    if not index_file.is_file():
        return {"tokens": 0, "chunks": 0}
    chunks = json.loads(index_file.read_text())["chunks"]
    return {"tokens": int(sum(c["dim"] or 0 for c in chunks)), "chunks": len(chunks)}


def _build(files, tmp: Path, tokenizer, text_field, val_fraction, chunk_tokens, num_workers) -> dict:
    """Write train/ (and val/) into `tmp`; return their token statistics."""
    stats = {}
    splits = [("train", False)] + ([("val", True)] if val_fraction > 0 else [])
    with _private_litdata_scratch(tmp):
        for name, want_val in splits:
            _optimize_split(files, tmp / name, tokenizer, text_field, want_val, val_fraction, chunk_tokens, num_workers)
            stats[name] = _split_stats(tmp / name)
    for scratch in tmp.glob("scratch-*"):
        shutil.rmtree(scratch, ignore_errors=True)
    if stats["train"]["tokens"] == 0 and stats.get("val", {}).get("tokens", 0) == 0:
        raise InputError("the inputs contain no documents (every file is empty)")
    if stats["train"]["tokens"] == 0:
        raise InputError(f"no documents fell in the training split (val_fraction={val_fraction}); add data")
    return stats


def _publish(tmp: Path, final: Path) -> None:
    """Atomically move a finished build into place; if another process won the race, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "meta.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _result(final: Path, meta: dict) -> PreparedData:
    has_val = meta["stats"].get("val", {}).get("tokens", 0) > 0
    if meta["val_fraction"] > 0 and not has_val:
        log.warning("no document fell in the validation split (val_fraction=%s); validation is off", meta["val_fraction"])
    if meta["skipped_files"]:
        log.warning("%d input file(s) were skipped as not UTF-8 (listed in %s)", len(meta["skipped_files"]), final / "meta.json")
    return PreparedData(str(final / "train"), str(final / "val") if has_val else None, meta)


def default_num_workers(num_files: int) -> int:
    return max(1, min(8, os.cpu_count() or 1, num_files))


def prepare(
    data: list[str] | str | None,
    tokenizer: Tokenizer,
    cache_dir: str | os.PathLike = "data_cache",
    val_fraction: float = 0.005,
    text_field: str = "text",
    max_corpus_bytes: int | None = DEFAULT_MAX_CORPUS_BYTES,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    num_workers: int | None = None,
    strict: bool = False,
    build: bool = True,
) -> PreparedData:
    """Tokenize `data` into cached litdata chunks (or reuse the cache) and say where they are.

    `data`: paths, directories or globs of .txt/.md/.py/.jsonl/.parquet files; None for the
    embedded standard-library corpus (capped at `max_corpus_bytes`); or one already optimized litdata
    dataset (a directory with index.json, one with train/ and val/, or an s3:// URI), used as is.
    `build=False` only looks the cache up and raises if it is missing (for ranks that must not build).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    specs = [data] if isinstance(data, (str, os.PathLike)) else (None if data is None else [str(d) for d in data])
    if specs is not None:
        optimized = [find_optimized(s) for s in specs]
        if any(optimized):
            if len(specs) != 1:
                raise InputError(f"an optimized litdata dataset must be the only input, got {specs}")
            return PreparedData(optimized[0].train, optimized[0].val, {"prebuilt": True})

    files = _input_files(specs, max_corpus_bytes)
    workers = num_workers or default_num_workers(len(files))
    settings = {"val_fraction": val_fraction, "text_field": text_field, "chunk_tokens": chunk_tokens, "workers": workers}
    final = Path(cache_dir) / f"tokens-{_fingerprint(files, tokenizer, settings)}"
    if (final / "meta.json").is_file():
        log.info("reusing prepared tokens at %s", final)
        return _result(final, json.loads((final / "meta.json").read_text()))
    if not build:
        raise FileNotFoundError(f"prepared tokens not found at {final}; run prepare_data() (or prepare()) first")

    kept, skipped = _validate_files(files, text_field, strict)
    if not kept or sum(f.size for f in kept) == 0:
        raise InputError(f"the inputs contain no documents: {len(files)} file(s), {len(skipped)} skipped, the rest empty")

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        log.info("preparing %d file(s) with %s into %s", len(kept), tokenizer.name, final)
        stats = _build(kept, tmp, tokenizer, text_field, val_fraction, chunk_tokens, workers)
        meta = {
            **settings,
            "format": FORMAT_VERSION,
            "tokenizer": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "num_files": len(kept),
            "skipped_files": skipped,
            "stats": stats,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))  # written last: marks the build complete
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _result(final, meta)
