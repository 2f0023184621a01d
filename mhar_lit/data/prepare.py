"""Pre-tokenize raw text into litdata token chunks, cached by a fingerprint of everything that matters.

Layout of one prepared dataset (docs/method.md H.1: documents encoded without special tokens, each followed
by EOS, packed into one contiguous token stream with no padding):

    <cache_dir>/tokens-<fingerprint>/
        train/   index.json + chunk-0-*.bin   (litdata, TokensLoader, int32 tokens)
        val/     the same for the held-out documents (absent when val_fraction == 0 or none fell there)
        checksums.json                        (sha256 and size of every file of train/ and val/)
        meta.json                             (inputs, settings, token counts, skipped files)

The prepared stream is a function of the data, the tokenizer and the settings only: documents are read in
input order, tokenized in parallel batches, and written by one writer in document order, so any number of
preparation workers on any machine gives byte-identical chunks. The fingerprint covers each input file's
content (sha256; a touched but unchanged file does not rebuild), its suffix (which decides the parser), the
tokenizer and the split and chunking settings, so a matching cache is reused and any change rebuilds it.

Reliability rules:
- The build happens in a hidden staging folder `.tokens-<fingerprint>.tmp-<pid>-*` renamed into place only
  once complete: a crash or a bad input never leaves a half-written dataset that a later run would trust.
  Its owner holds a lock on `.lock` inside it; the next preparation in the same cache_dir removes staging
  folders whose lock is free (their process died), never those of a live concurrent build.
- `checksums.json` is checked once per file per process when a cached dataset is reused (prepare_data, on
  local rank 0 of each node): a changed chunk is an error naming the file and how to rebuild.
- Old copies do not pile up: a dataset's "source" is its input specification (paths / globs as given,
  resolved), tokenizer name and settings; when a new fingerprint of one source is built (its files or
  tokenizer content changed), only the newest KEEP_COPIES builds of that source are kept in cache_dir.

Chunks hold whole pieces of at most `chunk_tokens` tokens, and the streaming reader drops each chunk's last
`len(chunk) % (seq_len + 1)` tokens (blocks never span chunks), a loss below seq_len+1 per chunk.
"""

from __future__ import annotations

import contextlib
import queue
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mhar_lit.data import integrity
from mhar_lit.data.corpus import DEFAULT_MAX_CORPUS_BYTES, stdlib_corpus_files
from mhar_lit.data.sources import (
    TEXT_SUFFIXES,
    InputError,
    InputFile,
    check_parquet_field,
    expand_inputs,
    find_optimized,
    is_remote,
    is_valid_utf8,
    is_validation,
    iter_documents,
)
from mhar_lit.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bump when the on-disk layout or the tokenization recipe changes, to invalidate old caches.
# 2: one writer in document order (worker-count independent), content fingerprints, checksums.json.
FORMAT_VERSION = 2
DEFAULT_CHUNK_TOKENS = 1 << 22  # 4M tokens = 16 MiB of int32 per chunk file
MAX_PIECE_TOKENS = 1 << 16  # items handed to litdata; small enough to pack chunks densely
BATCH_CHARS = 1 << 20  # text per tokenization task: large enough to amortize the hand-off to a worker
BATCH_DOCS = 1024
PARALLEL_MIN_BYTES = 8 << 20  # below this, starting worker processes costs more than it saves
KEEP_COPIES = 2  # builds of one source kept in cache_dir (the newest, and the one before it)
DIGEST_MEMO = "input-digests.json"
STAGING_GLOB = ".tokens-*.tmp-*"


@dataclass(frozen=True)
class PreparedData:
    """Where the token chunks are. `val_dir` is None when there is no validation split."""

    train_dir: str
    val_dir: str | None
    meta: dict = field(default_factory=dict)


# ---------------------------------------------------------------- tokenization (optionally in worker processes)

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_in_worker(docs: list[str]) -> list[np.ndarray]:
    return _worker_tokenizer.encode_batch(docs)


def _document_batches(files: list[InputFile], text_field: str, val_fraction: float) -> Iterator[tuple[str, list[str]]]:
    """(split, documents) batches; each split's batches hold its documents in input order."""
    pending: dict[str, list[str]] = {"train": [], "val": []}
    chars = {"train": 0, "val": 0}
    for f in files:
        for doc in iter_documents(f.path, text_field):
            split = "val" if is_validation(doc, val_fraction) else "train"
            pending[split].append(doc)
            chars[split] += len(doc)
            if chars[split] >= BATCH_CHARS or len(pending[split]) >= BATCH_DOCS:
                yield split, pending[split]
                pending[split], chars[split] = [], 0
    for split, docs in pending.items():
        if docs:
            yield split, docs


def _start_method() -> str:
    # fork starts workers in milliseconds and, unlike spawn, does not require the calling script to
    # have an `if __name__ == "__main__":` guard. The workers only tokenize on the CPU, so fork's
    # usual hazards (CUDA in the child) do not apply. Platforms without fork use spawn.
    import multiprocessing as mp

    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def _encoded_batches(batches, tokenizer: Tokenizer, num_workers: int) -> Iterator[tuple[str, list[np.ndarray]]]:
    """Encode (split, docs) batches, yielding results in submission order whatever the worker count.

    At most 2 * num_workers batches are in flight, so memory stays bounded on any corpus size.
    """
    if num_workers <= 1:
        for split, docs in batches:
            yield split, tokenizer.encode_batch(docs)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context(_start_method())
    with ProcessPoolExecutor(num_workers, mp_context=ctx, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        in_flight: deque = deque()
        for split, docs in batches:
            in_flight.append((split, pool.submit(_encode_in_worker, docs)))
            if len(in_flight) >= 2 * num_workers:
                split_done, future = in_flight.popleft()
                yield split_done, future.result()
        while in_flight:
            split_done, future = in_flight.popleft()
            yield split_done, future.result()


# ---------------------------------------------------------------- writing


@contextlib.contextmanager
def _single_litdata_writer():
    """Make litdata's BinaryWriter name its chunks and index as rank 0 of one writer.

    Outside `optimize` the writer takes its rank from torch.distributed (prepare_data runs on each node's
    local rank 0), which would name chunks after the global rank; the optimize environment variable pins it.
    """
    key = "DATA_OPTIMIZER_GLOBAL_RANK"
    saved = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


class _SplitWriter:
    """Packs one split's token arrays (+ EOS each) into pieces of `piece_tokens` and writes them in order."""

    def __init__(self, out_dir: Path, chunk_tokens: int, eos_id: int):
        self.out_dir, self.chunk_tokens = out_dir, chunk_tokens
        self.piece_tokens = min(MAX_PIECE_TOKENS, chunk_tokens)
        self.eos = np.array([eos_id], dtype=np.int32)
        self.parts: list[np.ndarray] = []
        self.buffered = 0
        self.items = 0
        self._writer = None

    def add(self, encoded: list[np.ndarray]) -> None:
        for ids in encoded:
            self.parts += [ids.astype(np.int32, copy=False), self.eos]
            self.buffered += len(ids) + 1
        if self.buffered >= self.piece_tokens:
            joined = np.concatenate(self.parts)
            cut = len(joined) - len(joined) % self.piece_tokens
            for piece in np.split(joined[:cut], cut // self.piece_tokens):
                self._write(piece)
            self.parts, self.buffered = [joined[cut:]], len(joined) - cut

    def _write(self, piece: np.ndarray) -> None:
        import torch
        from litdata.streaming.item_loader import TokensLoader
        from litdata.streaming.writer import BinaryWriter

        if self._writer is None:
            # the message queue takes litdata's "Rank 0 inferred the following data format" line, printed at
            # every preparation otherwise: the format is always TokensLoader's int32 tensor
            self._writer = BinaryWriter(str(self.out_dir), chunk_size=self.chunk_tokens, item_loader=TokensLoader(),
                                        msg_queue=queue.SimpleQueue())
        self._writer.add_item(self.items, torch.from_numpy(np.ascontiguousarray(piece)))
        self.items += 1

    def close(self) -> dict:
        """Flush, write index.json (deterministic: no timestamp) and return the split's statistics."""
        if self.buffered:
            self._write(np.concatenate(self.parts))
        if self._writer is None:
            return {"tokens": 0, "chunks": 0}
        self._writer.done()
        worker_index = self.out_dir / "0.index.json"
        index = json.loads(worker_index.read_text())
        (self.out_dir / "index.json").write_text(json.dumps(index, sort_keys=True))
        worker_index.unlink()
        return {"tokens": int(sum(c["dim"] or 0 for c in index["chunks"])), "chunks": len(index["chunks"])}


def _build(files, tmp: Path, tokenizer: Tokenizer, text_field, val_fraction, chunk_tokens, num_workers) -> dict:
    """Write train/ (and val/) and checksums.json into `tmp`; return the splits' token statistics."""
    writers = {name: _SplitWriter(tmp / name, chunk_tokens, tokenizer.eos_id) for name in ("train", "val")}
    batches = _document_batches(files, text_field, val_fraction)
    with _single_litdata_writer():
        for split, encoded in _encoded_batches(batches, tokenizer, num_workers):
            writers[split].add(encoded)
        stats = {name: w.close() for name, w in writers.items()}
    if val_fraction <= 0:
        del stats["val"]
    if stats["train"]["tokens"] == 0 and stats.get("val", {}).get("tokens", 0) == 0:
        raise InputError("the inputs contain no documents (every file is empty)")
    if stats["train"]["tokens"] == 0:
        raise InputError(f"no documents fell in the training split (val_fraction={val_fraction}); add data")
    integrity.write_manifest(tmp, sorted(p for split in ("train", "val") for p in (tmp / split).glob("*")))
    return stats


# ---------------------------------------------------------------- main-process side


def _input_files(data: list[str] | None, max_corpus_bytes: int | None) -> list[InputFile]:
    if data is None:
        return [InputFile.from_path(p) for p in stdlib_corpus_files(max_corpus_bytes)]
    return expand_inputs(data)


def input_digests(files: list[InputFile], cache_dir: str | os.PathLike) -> list[str]:
    """sha256 of each input file's content (memoized in cache_dir by size, mtime and inode)."""
    return integrity.content_digests([f.path for f in files], Path(cache_dir) / DIGEST_MEMO)


def _fingerprint(files: list[InputFile], digests: list[str], tokenizer: Tokenizer, settings: dict) -> str:
    payload = {
        "format": FORMAT_VERSION,
        # Content, size and parser (suffix) in input order; not the path or mtime: a moved or touched but
        # unchanged corpus gives the same tokens.
        "files": [(f.suffix, f.size, digest) for f, digest in zip(files, digests, strict=True)],
        "tokenizer": tokenizer.fingerprint,
        **settings,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def _source_key(specs: list[str] | None, max_corpus_bytes, tokenizer: Tokenizer, settings: dict) -> str:
    """What a dataset is prepared from, apart from content: builds sharing it are versions of one another."""
    inputs = ["stdlib", max_corpus_bytes] if specs is None else [os.path.abspath(s) for s in specs]
    payload = {"inputs": inputs, "tokenizer": tokenizer.name, **settings}
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


def _publish(tmp: Path, final: Path) -> None:
    """Atomically move a finished build into place; if another process won the race, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "meta.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _read_meta(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def _prune_old_copies(cache_dir: Path, source: str, keep: int = KEEP_COPIES) -> list[Path]:
    """Remove all but the newest `keep` builds of `source`; return the removed folders.

    Each is first renamed to a staging name (atomic), so a reader sees a whole dataset or none; an interrupted
    removal leaves a lockless staging folder that the next preparation removes.
    """
    copies = [(meta.get("created", 0.0), folder) for folder in cache_dir.glob("tokens-*")
              if (meta := _read_meta(folder)) is not None and meta.get("source") == source]
    removed = []
    for _, folder in sorted(copies, reverse=True)[keep:]:
        doomed = folder.with_name(f".{folder.name}.tmp-{os.getpid()}-removing")
        with contextlib.suppress(OSError):
            os.rename(folder, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(folder)
            log.info("removed an older preparation of the same inputs: %s", folder)
    return removed


def _rebuild_hint(final: Path) -> str:
    return (f"Delete {final} (or the whole data.cache_dir {final.parent}) and run again to prepare the tokens anew; "
            "if this repeats, check the disk.")


def verify_prepared(final: Path, required: bool = True) -> None:
    """Check a prepared dataset against its checksums.json (each file once per process); log the cost. A cache
    folder written here always has one, so its absence means the folder was damaged (an error); a prebuilt
    dataset (required=False) may lack it: its chunks are then read unverified, which is said."""
    if not (final / integrity.MANIFEST_NAME).is_file():
        if required:
            raise integrity.CorruptFileError(f"prepared tokens at {final} have no {integrity.MANIFEST_NAME}, so their "
                                             f"chunks cannot be checked. {_rebuild_hint(final)}")
        log.warning("%s has no %s: its chunks are read unverified", final, integrity.MANIFEST_NAME)
        return
    start = time.perf_counter()
    read = integrity.verify_manifest(final, _rebuild_hint(final))
    if read:
        log.info("verified %.1f MB of prepared tokens in %.2f s (%s)", read / 1e6, time.perf_counter() - start, final)


def _result(final: Path, meta: dict, report: bool) -> PreparedData:
    """Where the prepared splits are; `report`: warn about what the preparation found (once per fit: the build or
    reuse in prepare_data reports, the lookup in setup does not)."""
    has_val = meta["stats"].get("val", {}).get("tokens", 0) > 0
    if report and meta["val_fraction"] > 0 and not has_val:
        log.warning("no document fell in the validation split (val_fraction=%s); validation is off", meta["val_fraction"])
    if report and meta["skipped_files"]:
        log.warning("%d input file(s) were skipped as not UTF-8 (listed in %s)", len(meta["skipped_files"]), final / "meta.json")
    return PreparedData(str(final / "train"), str(final / "val") if has_val else None, meta)


def default_num_workers(total_bytes: int) -> int:
    """Tokenization processes: the output does not depend on it, only the preparation time does."""
    if total_bytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(8, os.cpu_count() or 1))


def _prebuilt(spec: str, verify: bool) -> PreparedData:
    found = find_optimized(spec)
    parent = Path(found.train).parent
    if verify and not is_remote(found.train):
        verify_prepared(parent, required=False)  # one written by `prepare` carries its checksums
    return PreparedData(found.train, found.val, {"prebuilt": True})


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
    verify: bool = True,
) -> PreparedData:
    """Tokenize `data` into cached litdata chunks (or reuse the cache) and say where they are.

    `data`: paths, directories or globs of .txt/.md/.py/.jsonl/.parquet files; None for the
    embedded standard-library corpus (capped at `max_corpus_bytes`); or one already optimized litdata
    dataset (a directory with index.json, one with train/ and val/, or an s3:// URI), used as is.
    `num_workers`: tokenization processes (default: 1 below 8 MB of input, else min(8, CPUs)); the prepared
    tokens are the same for any value. `build=False` only looks the cache up and raises if it is missing (for
    ranks that must not build, and for setup after prepare_data) and repeats none of the build's warnings.
    `verify` checks a reused dataset's chunk checksums (once per file per process).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise InputError(f"data.val_fraction must be in [0, 1), got {val_fraction} (training keeps the rest of the "
                         "documents; to score a whole file: python -m mhar_lit perplexity --data FILE)")
    specs = [data] if isinstance(data, (str, os.PathLike)) else (None if data is None else [str(d) for d in data])
    if specs is not None and any(find_optimized(s) for s in specs):
        if len(specs) != 1:
            raise InputError(f"an optimized litdata dataset must be the only input, got {specs}")
        return _prebuilt(specs[0], verify)

    files = _input_files(specs, max_corpus_bytes)
    settings = {"val_fraction": val_fraction, "text_field": text_field, "chunk_tokens": chunk_tokens}
    cache = Path(cache_dir)
    final = cache / f"tokens-{_fingerprint(files, input_digests(files, cache), tokenizer, settings)}"
    if build:
        for folder in integrity.remove_stale_staging_dirs(cache, STAGING_GLOB):
            log.warning("removed %s, left by an interrupted preparation", folder)
    if (final / "meta.json").is_file():
        log.info("reusing prepared tokens at %s", final)
        if verify:
            verify_prepared(final)
        return _result(final, json.loads((final / "meta.json").read_text()), report=build)
    if not build:
        raise FileNotFoundError(f"prepared tokens not found at {final}; run prepare_data() (or prepare()) first")

    source = _source_key(specs, max_corpus_bytes, tokenizer, settings)
    meta = _build_and_publish(files, final, tokenizer, settings, source, strict, num_workers)
    _prune_old_copies(cache, source)
    return _result(final, meta, report=True)


def _build_and_publish(files, final: Path, tokenizer, settings: dict, source: str, strict: bool, num_workers) -> dict:
    """Validate the inputs, build into a locked staging folder and rename it to `final`; return its meta."""
    text_field = settings["text_field"]
    kept, skipped = _validate_files(files, text_field, strict)
    if not kept or sum(f.size for f in kept) == 0:
        raise InputError(f"the inputs contain no documents: {len(files)} file(s), {len(skipped)} skipped, the rest empty")
    workers = num_workers or default_num_workers(sum(f.size for f in kept))

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    lock = integrity.hold_new_lock(tmp / integrity.LOCK_NAME)
    try:
        log.info("preparing %d file(s) with %s and %d worker(s) into %s", len(kept), tokenizer.name, workers, final)
        stats = _build(kept, tmp, tokenizer, text_field, settings["val_fraction"], settings["chunk_tokens"], workers)
        meta = {
            **settings,
            "format": FORMAT_VERSION,
            "tokenizer": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "num_files": len(kept),
            "skipped_files": skipped,
            "stats": stats,
            "source": source,
            "created": time.time(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))  # written last: marks the build complete
        (tmp / integrity.LOCK_NAME).unlink()  # the folder is young: no cleaner takes it before the rename
        lock.close()
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.close()
    return meta

