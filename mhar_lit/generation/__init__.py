"""Text generation from a trained or converted DecoderLM: a static KV cache, sampling, the `generate` command.

    cache = KVCache.for_model(model, batch, max_len)
    logits = prefill(model, ids, mask, cache)          left-padded prompts
    logits = decode_step(model, tokens, cache)         one token per row
    generate(model, prompts, max_new_tokens, Sampling(temperature=0.8, top_p=0.95), generator, eos_ids, stop)

See mhar_lit.generation.cache for why one key/value cache serves every residual strategy.
"""

from mhar_lit.generation.cache import KVCache
from mhar_lit.generation.decoding import (
    PromptTooLongError,
    cut_at_stop,
    decode_step,
    generate,
    left_pad,
    prefill,
    torch_routing,
)
from mhar_lit.generation.sampling import Sampling, filter_logits, next_tokens

__all__ = [
    "KVCache",
    "PromptTooLongError",
    "Sampling",
    "cut_at_stop",
    "decode_step",
    "filter_logits",
    "generate",
    "left_pad",
    "next_tokens",
    "prefill",
    "torch_routing",
]
