"""A decode step captured once in a CUDA graph and replayed at every position.

Why a CUDA graph of the eager step rather than torch.compile(mode="reduce-overhead"): the static cache keeps
its bookkeeping in tensors (mhar_lit.generation.cache), so one capture is valid at every position; capturing
costs one warm-up step and starts in milliseconds, where compiling a 28-layer model takes tens of seconds and
compiles again for every new cache length or batch (generate sizes its cache per call), which would defeat a
command that must answer within seconds. The replayed kernels are the eager step's, on the same shapes, so
the graph computes what the eager step computes (the graph loop's tokens equal the eager loop's: a CUDA test).
The kernel count that compile would have fused away is cut by hand where it matters (decode routing in
mhar_lit.generation.routing, GQA attention without copies in cache.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mhar_lit.generation.cache import KVCache


class CapturedStep:
    """`step(model, tokens, cache)` (a decode step: one token per row -> logits [B, V]) captured on `cache`.

    Calling it copies the tokens into the graph's input and replays: the cache advances on the GPU exactly as
    an eager step would advance it. The returned logits live in the graph's output buffer and are overwritten
    by the next call: read them (sample) before calling again."""

    def __init__(self, step: Callable[[torch.nn.Module, Tensor, KVCache], Tensor], model: torch.nn.Module,
                 cache: KVCache, tokens_B: Tensor) -> None:
        if tokens_B.device.type != "cuda":
            raise RuntimeError(f"a CUDA graph needs the model on a CUDA device, not {tokens_B.device}")
        self.tokens = tokens_B.clone()
        bookkeeping = (cache.write_index, cache.next_position, cache.key_valid)
        saved = [t.clone() for t in bookkeeping]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (allocator, lazy initialisation); its cache update is undone below
            step(model, self.tokens, cache)
        torch.cuda.current_stream().wait_stream(side)
        for live, before in zip(bookkeeping, saved):  # the warm-up's keys and values are rewritten by the replay
            live.copy_(before)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step(model, self.tokens, cache)

    def __call__(self, tokens_B: Tensor) -> Tensor:
        self.tokens.copy_(tokens_B)
        self.graph.replay()
        return self.logits
