"""Incremental decoding with a KV cache: `prefill`, `decode_step` and the batched `generate` loop.

Every residual strategy decodes with the same per-layer key/value cache (see mhar_lit.generation.cache for
why): the strategy's loop runs on the new tokens only. Decode steps route with the decode routers
(`decode_routing`; mhar_lit.generation.routing, on CUDA through the decode kernels of
mhar_lit.kernels.decode_routing): one token's routing is a tiny problem, and the training kernels'
shared-buffer schedules assume a full forward. The prefill routes on the decode routers too: the training
forward's Triton router gave NaN logits for a padded prefill on an H100 (docs/LOG.md, 2026-12-07), so it is not
used here until a GPU test says it computes the decode router's function.

Two token loops, the same tokens (tested):

    "eager"    the reference: an eager step, the new tokens copied to the host after every step, EOS and stop
               strings checked there. The CPU default.
    "device"   the loop stays on the device: tokens are sampled into a device buffer and EOS is checked there;
               the host reads the buffer every `sync_every` steps (or when the caller streams text), then
               detokenizes incrementally and checks stop strings on the new text only. A row that finished
               between two reads has its later tokens dropped, so the result equals the eager loop's; the
               extra steps (at most sync_every - 1 once every row is done) are the price of not waiting on the
               host at every step.
    "graph"    "device" with the decode step captured once in a CUDA graph (mhar_lit.generation.graph): one
               replay per step instead of thousands of kernel launches. The CUDA default.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Optional

import torch
from torch import Tensor

from mhar_lit.generation.cache import KVCache
from mhar_lit.generation.graph import CapturedStep
from mhar_lit.generation.routing import DecodeCallRouter, DecodeFullRouter, decode_kernels_apply
from mhar_lit.generation.sampling import Sampling, next_tokens
from mhar_lit.generation.text import IncrementalText, StopMatcher

log = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    """A prompt that does not fit the model's context (max_position_embeddings)."""


@contextlib.contextmanager
def decode_routing(model: torch.nn.Module) -> Iterator[None]:
    """Route on the PyTorch backend inside the block, full- and call-mode strategies with the decode routers
    (mhar_lit.generation.routing: each source normalised once, a few kernels per site), and restore the model's
    routing choice after it (strategies without routing are left alone). A decode step routes one token per
    row: a tiny problem for which the fused training kernels' per-pass buffers and launches only add cost."""
    residual = getattr(model, "residual", None)
    if residual is None or not hasattr(residual, "set_routing_backend"):
        yield
        return
    original = residual.routing_choice
    residual.set_routing_backend("torch")
    # the strategy reads its router from this attribute; set_routing_backend below makes it again
    if residual.routing_mode == "full":
        residual._router = DecodeFullRouter(residual.heads, residual.eps)
    elif residual.routing_mode == "call":
        residual._router = DecodeCallRouter(residual.heads, residual.eps, getattr(residual, "null", None))
    try:
        yield
    finally:
        residual.set_routing_backend(*original)


@contextlib.contextmanager
def decode_ops(model: torch.nn.Module, fused_ops: Optional[bool]) -> Iterator[None]:
    """The model's elementwise ops while generating: liger's fused kernels if `fused_ops` (None: where they run
    compiled, _fused_ops_compile, or the model has them on), else the plain ops; the model's setting is restored
    after."""
    if getattr(model, "fused_ops", None) is None:  # not a DecoderLM: nothing to switch
        yield
        return
    before = [(module, module.fused_ops) for module in model._fusable_modules()]  # a mixed setting comes back too
    if fused_ops is None:
        fused_ops = model.fused_ops or _fused_ops_compile(model.embed_tokens.weight)
    model.fused_ops = fused_ops
    try:
        yield
    finally:
        for module, enabled in before:
            module.fused_ops = enabled


def _fused_ops_compile(weight: Tensor) -> bool:
    """Whether liger's kernels run compiled for a model whose weights are like `weight` (decode_kernels_apply with
    liger-kernel; an fp64 model stays plain, as liger computes in fp32)."""
    return decode_kernels_apply(weight, "liger_kernel")


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


MODES = ("auto", "eager", "device", "graph")


def resolve_mode(mode: str, device: torch.device) -> str:
    """The loop `mode` runs: "auto" is "graph" on CUDA and "eager" elsewhere; "graph" off CUDA is an error."""
    if mode not in MODES:
        raise ValueError(f"unknown decode mode {mode!r}; expected one of {MODES}")
    if mode == "auto":
        return "graph" if device.type == "cuda" else "eager"
    if mode == "graph" and device.type != "cuda":
        raise ValueError(f"decode mode 'graph' (a CUDA graph) needs a CUDA device, the model is on {device}")
    return mode


def cache_length(width: int, steps: int) -> int:
    """Columns of the cache: the prompt width plus the steps that feed a token back, rounded up to a multiple of
    16 so that the attention mask's rows are aligned for CUDA's fused masked kernel (extra columns are masked)."""
    return -(-(width + steps - 1) // 16) * 16


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: Sampling = Sampling(), generator: Optional[torch.Generator] = None,
             eos_ids: Sequence[int] = (), stop: Sequence[str] = (),
             decode: Optional[Callable[[list[int]], str]] = None,
             on_step: Optional[Callable[[list[list[int]], list[bool]], None]] = None,
             pad_id: int = 0, mode: str = "auto", sync_every: int = 8,
             fused_ops: Optional[bool] = None) -> list[list[int]]:
    """New tokens of each prompt (EOS excluded), batched with a KV cache.

    A row finishes at an EOS id, when its decoded text (`decode`, needed with `stop`) contains a stop string,
    or after `max_new_tokens` (capped at the model's context). Finished rows keep running in the batch
    (fixed shapes) but their tokens are ignored. `on_step(tokens, finished)` is called whenever the host has
    new tokens: after every step in the eager loop, every `sync_every` steps in the device loops (streaming).
    Stop strings end generation; cutting the text at them is the caller's (`cut_at_stop`). `mode`: "auto",
    "eager", "device" or "graph" (see the module docstring); every mode gives the same tokens. `fused_ops`:
    liger-kernel's RMSNorm, RoPE and SiLU * up while generating (DecoderLM.fused_ops; the same values to
    rounding); None turns them on for a model on CUDA where liger-kernel is installed and Triton compiles
    (1.6x the decode speed of a 350M model at batch 1 on an H100, benchmarks/results/speed_probe_2026-12-07)
    and leaves the model's own choice elsewhere; the model's setting is restored after the call.
    """
    if stop and decode is None:
        raise ValueError("stop strings need a decode function to check the text")
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    device = model.embed_tokens.weight.device
    mode = resolve_mode(mode, device)
    steps = new_token_budget(model, max(len(p) for p in prompts), max_new_tokens)
    if steps <= 0:
        return [[] for _ in prompts]
    ids, mask = left_pad(prompts, pad_id, device)
    cache = KVCache.for_model(model, len(prompts), cache_length(ids.shape[1], steps))
    rows = _Rows(len(prompts), eos_ids, stop, decode)
    # Triton launches on the current CUDA device: make it the model's (a model on cuda:1)
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device, decode_routing(model), decode_ops(model, fused_ops):
        logits = prefill(model, ids, mask, cache)
        if mode == "eager":
            _host_loop(model, cache, logits, steps, sampling, generator, rows, on_step)
        else:
            _device_loop(model, cache, logits, steps, sampling, generator, rows, on_step, sync_every,
                         capture=mode == "graph")
    return rows.tokens


class _Rows:
    """What the host knows of each row: its tokens, whether it finished, its text (only with stop strings)."""

    def __init__(self, batch: int, eos_ids: Sequence[int], stop: Sequence[str],
                 decode: Optional[Callable[[list[int]], str]]) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.finished = [False] * batch
        self.eos = set(int(e) for e in eos_ids)
        checks_text = any(stop)
        self.texts = [IncrementalText(decode) for _ in range(batch)] if checks_text else None
        self.matchers = [StopMatcher(stop) for _ in range(batch)] if checks_text else None

    def take(self, row: int, token: int) -> None:
        """One more token of `row` (ignored once the row has finished)."""
        if self.finished[row]:
            return
        if token in self.eos:
            self.finished[row] = True
            return
        self.tokens[row].append(token)
        if self.texts is not None:
            self.texts[row].push(token)
            self.finished[row] = self.matchers[row].found(self.texts[row].text)

    @property
    def done(self) -> bool:
        return all(self.finished)


def _host_loop(model: torch.nn.Module, cache: KVCache, logits: Tensor, steps: int, sampling: Sampling,
               generator: Optional[torch.Generator], rows: _Rows,
               on_step: Optional[Callable[[list[list[int]], list[bool]], None]]) -> None:
    """The reference loop: every step's tokens go to the host, which decides what each row keeps."""
    for step in range(steps):
        tokens = next_tokens(logits, sampling, generator)
        for row, token in enumerate(tokens.tolist()):
            rows.take(row, token)
        if on_step is not None:
            on_step(rows.tokens, rows.finished)
        if rows.done or step == steps - 1:
            break
        logits = decode_step(model, tokens, cache)


def _device_loop(model: torch.nn.Module, cache: KVCache, logits: Tensor, steps: int, sampling: Sampling,
                 generator: Optional[torch.Generator], rows: _Rows,
                 on_step: Optional[Callable[[list[list[int]], list[bool]], None]], sync_every: int,
                 capture: bool) -> None:
    """Tokens are sampled into a device buffer [B, sync_every] with EOS applied there (a row's tokens from its
    EOS on are -1); the host reads the buffer every sync_every steps and hands the tokens to `rows`."""
    device = logits.device
    eos = torch.tensor(sorted(rows.eos), device=device, dtype=torch.long)
    ended = torch.zeros(logits.shape[0], device=device, dtype=torch.bool)  # reached EOS on the device
    chunk = torch.empty(logits.shape[0], sync_every, device=device, dtype=torch.long)
    step_fn = None
    filled = 0
    for step in range(steps):
        tokens = next_tokens(logits, sampling, generator)
        ended |= torch.isin(tokens, eos)
        chunk[:, filled] = torch.where(ended, -1, tokens)
        filled += 1
        last = step == steps - 1
        if filled == sync_every or last:
            _read_chunk(chunk[:, :filled], rows)
            filled = 0
            if on_step is not None:
                on_step(rows.tokens, rows.finished)
            if rows.done:
                break
        if last:
            break
        if step_fn is None:
            step_fn = (CapturedStep(decode_step, model, cache, tokens) if capture
                       else lambda toks: decode_step(model, toks, cache))
        logits = step_fn(tokens)


def _read_chunk(chunk_BS: Tensor, rows: _Rows) -> None:
    """Move a chunk of tokens to the host (one sync) and give each row its tokens up to its end."""
    for row, tokens in enumerate(chunk_BS.tolist()):
        for token in tokens:
            if token < 0:
                rows.finished[row] = True
                break
            rows.take(row, token)
