"""Incremental decoding with a KV cache: `prefill`, `decode_step` and the batched `generate` loop.

Every residual strategy decodes with the same per-layer key/value cache (see mhar_lit.generation.cache for
why): the strategy's loop runs on the new tokens only. Routing runs on the PyTorch backend while decoding
(`torch_routing`): one token's routing is a tiny problem, and the fused kernels' shared-buffer schedules
assume a full training forward.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Optional

import torch
from torch import Tensor

from mhar_lit.generation.cache import KVCache
from mhar_lit.generation.sampling import Sampling, next_tokens

log = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    """A prompt that does not fit the model's context (max_position_embeddings)."""


@contextlib.contextmanager
def torch_routing(model: torch.nn.Module) -> Iterator[None]:
    """Route on the PyTorch backend inside the block and restore the model's routing choice after it
    (strategies without routing are left alone). A decode step routes one token per row: a tiny problem for which
    the fused kernels' per-pass buffers and launches only add cost."""
    residual = getattr(model, "residual", None)
    if residual is None or not hasattr(residual, "set_routing_backend"):
        yield
        return
    original = residual.routing_choice
    residual.set_routing_backend("torch")
    try:
        yield
    finally:
        residual.set_routing_backend(*original)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0,
             device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """(ids [B, T], real-token mask [B, T]) with every prompt right-aligned, so that all rows end together."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = True
    return ids.to(device), mask.to(device)


def prefill(model: torch.nn.Module, input_ids: Tensor, attention_mask: Optional[Tensor], cache: KVCache) -> Tensor:
    """Run left-padded prompts [B, T] through the model into `cache`; logits [B, V] of each row's last token."""
    cache.next_valid = attention_mask
    hidden = model.hidden_states(input_ids, cache)
    return model.lm_head(hidden[:, -1])  # the LM head at the last column only: [B, T, V] can be gigabytes


def decode_step(model: torch.nn.Module, tokens_B: Tensor, cache: KVCache) -> Tensor:
    """Feed one token per row; logits [B, V] for the token after it. Fixed shapes for a given cache."""
    hidden = model.hidden_states(tokens_B.unsqueeze(1), cache)
    return model.lm_head(hidden[:, -1])


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` up to the earliest occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=len(text))
    return text[:cut]


def new_token_budget(model: torch.nn.Module, longest_prompt: int, max_new_tokens: int) -> int:
    """max_new_tokens, capped so that no row runs past the model's context; a prompt over it is an error."""
    context = model.config.max_position_embeddings
    if longest_prompt > context:
        raise PromptTooLongError(f"prompt of {longest_prompt} tokens is longer than the model's context of "
                                 f"{context} tokens (max_position_embeddings)")
    if longest_prompt + max_new_tokens > context:
        log.warning("generation capped at %d new tokens: the model's context is %d tokens", context - longest_prompt,
                    context)
    return min(max_new_tokens, context - longest_prompt)


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: Sampling = Sampling(), generator: Optional[torch.Generator] = None,
             eos_ids: Sequence[int] = (), stop: Sequence[str] = (),
             decode: Optional[Callable[[list[int]], str]] = None,
             on_step: Optional[Callable[[list[list[int]], list[bool]], None]] = None,
             pad_id: int = 0) -> list[list[int]]:
    """New tokens of each prompt (EOS excluded), batched with a KV cache.

    A row finishes at an EOS id, when its decoded text (`decode`, needed with `stop`) contains a stop string,
    or after `max_new_tokens` (capped at the model's context). Finished rows keep running in the batch
    (fixed shapes) but their tokens are ignored. `on_step(tokens, finished)` is called after every step
    (streaming). Stop strings end generation; cutting the text at them is the caller's (`cut_at_stop`).
    """
    if stop and decode is None:
        raise ValueError("stop strings need a decode function to check the text")
    steps = new_token_budget(model, max(len(p) for p in prompts), max_new_tokens)
    out: list[list[int]] = [[] for _ in prompts]
    if steps <= 0:
        return out
    device = model.embed_tokens.weight.device
    ids, mask = left_pad(prompts, pad_id, device)
    cache = KVCache.for_model(model, len(prompts), ids.shape[1] + steps - 1)
    finished = [False] * len(prompts)
    eos = set(int(e) for e in eos_ids)
    with torch_routing(model):
        logits = prefill(model, ids, mask, cache)
        for step in range(steps):
            tokens = next_tokens(logits, sampling, generator)
            for row, token in enumerate(tokens.tolist()):
                if finished[row]:
                    continue
                if token in eos:
                    finished[row] = True
                    continue
                out[row].append(token)
                if stop and any(s in decode(out[row]) for s in stop if s):
                    finished[row] = True
            if on_step is not None:
                on_step(out, finished)
            if all(finished) or step == steps - 1:
                break
            logits = decode_step(model, tokens, cache)
    return out
