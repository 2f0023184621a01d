"""Perplexity of a model on a text file or a prepared token corpus.

    result = perplexity("runs/.../last.ckpt", "held_out.txt", seq_len=1024)
    result = perplexity("exported/", "cache/tokens-<fingerprint>/val")        a prepared (litdata) split
    result.perplexity, result.loss, result.tokens

How tokens are scored, the same way as training's validation loss: the text is one document, tokenized
without special tokens and followed by EOS (as `prepare` writes documents); the token stream is cut into
windows of seq_len + 1 tokens that share their boundary token, so every token after the first is predicted
exactly once, from the earlier tokens of its window (the context restarts at each window). A prepared split is
read as training reads it: blocks of seq_len + 1 tokens, each chunk's tail that fills no block left out. The
loss is the mean next-token negative log-likelihood in nats (fp32 log-softmax), perplexity its exponential.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PerplexityResult:
    """loss: mean next-token NLL in nats over `tokens` predicted tokens; perplexity = exp(loss)."""

    loss: float
    perplexity: float
    tokens: int
    windows: int
    seq_len: int


def perplexity(model: str | Path, data: str | Path, seq_len: Optional[int] = None, batch_size: int = 8,
               tokenizer: Optional[str] = None, eos: Optional[str | int] = None, split: str = "val",
               device: Optional[str | torch.device] = None, dtype: str = "auto",
               max_tokens: Optional[int] = None, allow_unverified: bool = False) -> PerplexityResult:
    """Perplexity of `model` (a Lightning .ckpt written by `fit`, or a directory written by `convert` or
    `export`) on `data`: a text file (UTF-8, tokenized with the model's own tokenizer or `tokenizer`/`eos` as
    `generate` takes them), or a prepared corpus (a litdata split folder holding index.json, or a prepared
    dataset folder whose `split` subfolder is read: "val" by default).

    seq_len: tokens of context per window (default: the model's max_position_embeddings). batch_size: windows
    per forward. device: default CUDA when available. dtype: "auto" (bf16 on CUDA, fp32 elsewhere), "float32",
    "bfloat16" or "float16". max_tokens: score at most this many predicted tokens (the first ones).
    A .ckpt is read by the checkpoint reader (mhar_lit.checkpoint), which refuses a file whose sha256 sidecar
    is missing unless `allow_unverified`, and one that does not match it always.
    Bad arguments raise ValueError or FileNotFoundError with one line naming what to change."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = _dtype(dtype, device)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    data = Path(data)
    if not data.exists():
        raise FileNotFoundError(f"{data} does not exist: pass a text file or a prepared corpus folder")
    if data.is_dir():
        split_dir = _split_folder(data, split)
        loaded = _load_model(model, device, torch_dtype, allow_unverified)
        seq_len = _seq_len(loaded, seq_len)
        windows = _prepared_blocks(split_dir, seq_len)
    else:
        from mhar_lit.generation.loading import load_generator

        generator = load_generator(str(model), tokenizer, eos, device, torch_dtype, allow_unverified=allow_unverified)
        loaded = generator.model
        seq_len = _seq_len(loaded, seq_len)
        ids = generator.encode(data.read_text(encoding="utf-8")) + [generator.eos_ids[0]]
        windows = text_windows(ids, seq_len)
    if max_tokens is not None:
        windows = capped(windows, max_tokens)
    loss_sum, count, seen = score_windows(loaded, windows, batch_size)
    if count == 0:
        raise ValueError(f"{data} holds no window of {seq_len} + 1 tokens to score: pass a smaller seq_len")
    loss = loss_sum / count
    return PerplexityResult(loss, math.exp(loss), count, seen, seq_len)


def text_windows(ids: list[int], seq_len: int) -> Iterator[Tensor]:
    """Windows of at most seq_len + 1 tokens that overlap by one token: every token but the first is a target
    once. The last window may be shorter (at least 2 tokens)."""
    for start in range(0, max(len(ids) - 1, 0), seq_len):
        yield torch.tensor(ids[start:start + seq_len + 1], dtype=torch.long)


@torch.no_grad()
def score_windows(model: torch.nn.Module, windows: Iterable[Tensor], batch_size: int = 8) -> tuple[float, int, int]:
    """(sum of next-token NLL in nats, predicted tokens, windows) of `model` over token windows [<= T + 1].
    Consecutive windows of equal length are batched; the LM head runs on slices of positions so that
    [B, T, V] fp32 logits are never held at once."""
    device = model.embed_tokens.weight.device
    total, count, seen = 0.0, 0, 0
    batch: list[Tensor] = []
    for window in itertools.chain(windows, [None]):  # None flushes the last batch
        if batch and (window is None or len(batch) == batch_size or window.shape[0] != batch[0].shape[0]):
            block = torch.stack(batch).to(device)
            total += _batch_nll(model, block)
            count += block.numel() - block.shape[0]
            seen += block.shape[0]
            batch.clear()
        if window is not None:
            batch.append(window)
    return total, count, seen


def capped(windows: Iterable[Tensor], max_tokens: int) -> Iterator[Tensor]:
    """The first windows, the last one shortened, holding max_tokens targets in all."""
    left = max_tokens
    for window in windows:
        if left <= 0:
            return
        window = window[: left + 1]
        left -= window.shape[0] - 1
        yield window


def _batch_nll(model: torch.nn.Module, block: Tensor, positions_per_slice: int = 1024) -> float:
    inputs, targets = block[:, :-1], block[:, 1:]
    hidden = model.hidden_states(inputs)
    total = 0.0
    for start in range(0, inputs.shape[1], positions_per_slice):
        piece = slice(start, start + positions_per_slice)
        logits = model.lm_head(hidden[:, piece]).float()
        total += F.cross_entropy(logits.flatten(0, 1), targets[:, piece].flatten(), reduction="sum").item()
    return total


def _seq_len(model: torch.nn.Module, seq_len: Optional[int]) -> int:
    context = model.config.max_position_embeddings
    seq_len = context if seq_len is None else seq_len
    if not 1 <= seq_len <= context:
        raise ValueError(f"seq_len must be between 1 and the model's context of {context} tokens, got {seq_len}")
    return seq_len


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _split_folder(data: Path, split: str) -> Path:
    """A litdata split folder (index.json) as given, or the `split` folder of a prepared dataset."""
    if (data / "index.json").is_file():
        return data
    if (data / split / "index.json").is_file():
        return data / split
    raise FileNotFoundError(f"{data} is not a prepared corpus: expected index.json in it or in {data / split}")


def _load_model(source: str | Path, device: torch.device, dtype: torch.dtype,
                allow_unverified: bool) -> torch.nn.Module:
    """The model alone (a prepared corpus needs no tokenizer): a converted / exported directory or a .ckpt
    (verified as a text file's is)."""
    path = Path(source)
    if path.is_dir():
        from mhar_lit.convert import load_pretrained

        return load_pretrained(path, device=device, dtype=dtype)
    if path.is_file():
        from mhar_lit.checkpoint import read_checkpoint

        contents = read_checkpoint(path, allow_unverified=allow_unverified, with_tokenizer=False)
        return contents.model.to(device=device, dtype=dtype).eval()
    raise FileNotFoundError(f"{source} is neither a checkpoint file nor a converted model directory")


def _prepared_blocks(split_dir: Path, seq_len: int) -> Iterator[Tensor]:
    """Blocks of seq_len + 1 tokens of a litdata split, in order (as the validation loader reads them)."""
    from litdata import StreamingDataset, TokensLoader

    dataset = StreamingDataset(str(split_dir), item_loader=TokensLoader(block_size=seq_len + 1), shuffle=False,
                               drop_last=True)
    for block in dataset:
        yield block.to(torch.long)
