"""The probe's fixed held-out token set: a token-id file, raw text/jsonl, a litdata dataset, or the embedded corpus.

Held-out text is chosen exactly like the data layer's validation split (`is_validation`, a content hash):
a document is held out when its hash falls below `val_fraction`, so any fraction at or below the one used
for training selects only documents the model never trained on. The result is always [sequences, seq_len].
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

DEFAULT_VAL_FRACTION = 0.005  # the data layer's default validation fraction (mhar_lit.data.prepare)


def _non_integer_ids(path: str, dtype: Any) -> ValueError:
    # Casting floats (or bools) to int64 would silently turn e.g. probabilities into all-zero ids.
    return ValueError(f"{path}: token ids must be integers, found dtype {str(dtype).removeprefix('torch.')}")


def load_token_file(path: str) -> Tensor:
    """Token ids from a .npy or .pt file (1-D stream or 2-D [sequences, length]) as int64."""
    suffix = Path(path).suffix.lower()
    if suffix == ".npy":
        array = np.load(path, allow_pickle=False)
        if not np.issubdtype(array.dtype, np.integer):
            raise _non_integer_ids(path, array.dtype)
        ids = torch.from_numpy(array.astype(np.int64))
    elif suffix in (".pt", ".pth"):
        ids = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(ids, Tensor):
            raise ValueError(f"{path} must hold a single tensor of token ids, found {type(ids).__name__}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise _non_integer_ids(path, ids.dtype)
        ids = ids.long()
    else:
        raise ValueError(f"--tokens-file must be .npy or .pt, got {path}")
    if ids.dim() not in (1, 2) or ids.numel() == 0:
        raise ValueError(f"{path}: expected a non-empty 1-D or 2-D array of token ids, got shape {tuple(ids.shape)}")
    return ids


def to_sequences(ids: Tensor, max_tokens: int, seq_len: int) -> Tensor:
    """[sequences, length] of at most max_tokens tokens; a 1-D stream is cut into seq_len pieces.

    A 2-D input keeps its own rows (whole rows only). The tail that does not fill a row is dropped.
    """
    if ids.dim() == 2:
        rows = max(1, min(ids.shape[0], max_tokens // ids.shape[1]))
        return ids[:rows].contiguous()
    length = min(seq_len, ids.numel())
    rows = min(ids.numel(), max_tokens) // length
    if rows == 0:
        raise ValueError(f"--tokens {max_tokens} is smaller than one sequence of {length} tokens")
    return ids[: rows * length].view(rows, length).contiguous()


def _stream_documents(files: list[str], tokenizer: Any, val_fraction: float, text_field: str,
                      max_tokens: int) -> np.ndarray:
    """Held-out documents of the files, in order, tokenized (each followed by EOS) until max_tokens."""
    from mhar_lit.data.sources import is_validation, iter_documents

    pieces, total = [], 0
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    for path in files:
        for doc in iter_documents(path, text_field):
            if not is_validation(doc, val_fraction):
                continue
            ids = np.concatenate([tokenizer.encode_batch([doc])[0].astype(np.int64), eos])
            pieces.append(ids)
            total += len(ids)
            if total >= max_tokens:
                return np.concatenate(pieces)[:max_tokens]
    if not pieces:
        raise ValueError(f"no held-out documents (val_fraction={val_fraction}) in {len(files)} file(s)")
    return np.concatenate(pieces)


def _stream_optimized(input_dir: str, max_tokens: int, seq_len: int) -> np.ndarray:
    """The first max_tokens tokens of a litdata TokensLoader dataset, in stored order (no shuffling)."""
    from litdata import StreamingDataset, TokensLoader

    dataset = StreamingDataset(input_dir, item_loader=TokensLoader(block_size=seq_len), shuffle=False)
    pieces, total = [], 0
    for index in range(len(dataset)):
        block = np.asarray(dataset[index], dtype=np.int64)
        pieces.append(block)
        total += len(block)
        if total >= max_tokens:
            break
    if not pieces:
        raise ValueError(f"the litdata dataset {input_dir} holds fewer than {seq_len} tokens")
    return np.concatenate(pieces)[:max_tokens]


def heldout_tokens(data: Optional[str], tokenizer: Any, max_tokens: int, seq_len: int,
                   val_fraction: float = DEFAULT_VAL_FRACTION, text_field: str = "text") -> tuple[Tensor, dict]:
    """A 1-D held-out token stream and a description of where it came from (for the report).

    data: None for the embedded corpus; a text/jsonl/parquet file, directory or glob; or an optimized
    litdata dataset (its val/ split when there is one, else the dataset itself, which may be training data).
    """
    from mhar_lit.data.sources import expand_inputs, find_optimized

    optimized = find_optimized(data) if data is not None else None
    if optimized is not None:
        split = optimized.val or optimized.train
        ids = _stream_optimized(split, max_tokens, seq_len)
        return torch.from_numpy(ids), {"kind": "litdata", "path": split, "held_out": optimized.val is not None}
    if data is None:
        from mhar_lit.data.corpus import stdlib_corpus_files

        files, kind = [str(p) for p in stdlib_corpus_files()], "embedded"
    else:
        files, kind = [f.path for f in expand_inputs([data])], "documents"
    ids = _stream_documents(files, tokenizer, val_fraction, text_field, max_tokens)
    return torch.from_numpy(ids), {"kind": kind, "path": data, "val_fraction": val_fraction,
                                   "tokenizer": getattr(tokenizer, "name", type(tokenizer).__name__)}
