"""Choosing the next token: greedy, or sampling with temperature, top-k and top-p (nucleus).

Sampling draws from a `torch.Generator`, so a fixed seed gives the same tokens on the same device. The
filters follow the usual definitions (as transformers applies them: temperature, then top-k, then top-p):
top-k keeps the k most likely tokens (ties at the k-th value are kept), top-p keeps the smallest set of most
likely tokens whose probability reaches p (always at least one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy decoding (top_k / top_p are then irrelevant)."""

    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits_BV: Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None) -> Tensor:
    """Logits with -inf outside the top-k / top-p support (a new tensor)."""
    logits = logits_BV.clone()
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits.masked_fill_(logits < kth, float("-inf"))  # not logits[mask] = ...: boolean indexing syncs the host
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # probability of the more likely tokens
        drop_sorted = mass_before >= top_p  # the first token has mass_before 0 and is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits.masked_fill_(drop, float("-inf"))
    return logits


def next_tokens(logits_BV: Tensor, sampling: Sampling, generator: Optional[torch.Generator] = None) -> Tensor:
    """One token per row [B] (int64) from the last position's logits [B, V]."""
    if sampling.greedy:
        return logits_BV.argmax(-1)
    logits = filter_logits(logits_BV.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
