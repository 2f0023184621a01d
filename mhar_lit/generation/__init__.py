"""Text generation from a trained or converted DecoderLM: a static KV cache, sampling, the `generate` command.

    cache = KVCache.for_model(model, batch, max_len)
    logits = prefill(model, ids, mask, cache)          left-padded prompts
    logits = decode_step(model, tokens, cache)         one token per row
    generate(model, prompts, max_new_tokens, Sampling(temperature=0.8, top_p=0.95), generator, eos_ids, stop)
    generate(..., mode="graph")                        the device-side loop with a CUDA-graph step (CUDA default)

See mhar_lit.generation.cache for why one key/value cache serves every residual strategy, and
mhar_lit.generation.decoding for the token loops.
"""

from mhar_lit.generation.cache import KVCache
from mhar_lit.generation.decoding import (
    PromptTooLongError,
    cut_at_stop,
    decode_routing,
    decode_step,
    generate,
    left_pad,
    prefill,
)
from mhar_lit.generation.sampling import Sampling, filter_logits, next_tokens
from mhar_lit.generation.text import IncrementalText, StopMatcher

__all__ = [
    "IncrementalText",
    "KVCache",
    "PromptTooLongError",
    "Sampling",
    "StopMatcher",
    "cut_at_stop",
    "decode_routing",
    "decode_step",
    "filter_logits",
    "generate",
    "left_pad",
    "next_tokens",
    "prefill",
]
