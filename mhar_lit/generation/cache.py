"""A static, preallocated key/value cache for incremental decoding of a DecoderLM.

Why a plain KV cache is enough for every residual strategy: depth routing (full, block, delta attention
residuals, hyper-connections) mixes the sublayer outputs of the SAME token only, never across tokens. The only
state that one token passes to later ones is attention's keys and values, so a cached forward keeps those
per layer and runs the strategy's fixed loop (`begin`, `sublayer_input`, `sublayer_output`, `final`) on the
new tokens alone: their depth state is rebuilt from their embeddings at every step, exactly as the full
forward builds it for them.

Layout: keys and values [layers, B, kv_heads, max_len, head_dim], allocated once, so a decode step has fixed
shapes (its attention reads all max_len columns under a mask) and its bookkeeping lives in tensors
(`write_index`, `next_position`, `key_valid`), never in Python numbers: the step compiles to one graph that
stays valid at every position (torch.compile(fullgraph=True) with no recompilation) and can be captured in a
CUDA graph. For the same reason nothing checks on the host that a write fits: the caller sizes the cache
(`generate` does); a write past max_len fails in index_copy_.

A batch of prompts of different lengths is left-padded: every row writes the same column at each step, a
row's RoPE positions count only its real tokens (its first real token is position 0), and padded keys are
masked. A padded query attends to itself only, so its (unused) activations stay finite.

The first call on an empty cache (a prompt's prefill) attends over its own tokens only: nothing earlier is
cached, so the max_len - T columns after them are masked anyway. Unpadded, that is the training forward's own
call, causal SDPA with GQA (no mask: the fused causal kernel), so the prefill computes what the full forward
computes; a left-padded batch takes the masked path below over T columns instead of max_len. Later calls
(decode steps, or a prompt fed in pieces) attend over the whole cache, with fixed shapes.

Attention over the cache (`grouped_attention`): the mask is additive (0 or -inf, in the activation dtype) and
grouped-query heads are folded into the query length: the G query heads that share a key/value head become G
query rows of one head, so SDPA sees plain multi-head attention over the cached keys. With a boolean mask and
`enable_gqa`, PyTorch sends GQA to its math kernel, which also copies every cached key and value G times per
step; folded, nothing is expanded and a masked fused kernel (memory-efficient attention on CUDA) can run.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


class KVCache:
    """Keys and values of the tokens seen so far, for `DecoderLM.hidden_states(ids, cache=...)`."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if batch < 1 or max_len < 1:
            raise ValueError(f"a KV cache needs batch >= 1 and max_len >= 1, got {batch} and {max_len}")
        shape = (num_layers, batch, kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.key_valid = torch.zeros(batch, max_len, device=device, dtype=torch.bool)
        self.next_position = torch.zeros(batch, device=device, dtype=torch.long)  # RoPE position per row
        self.write_index = torch.zeros((), device=device, dtype=torch.long)  # column of the next token
        self.next_valid: Optional[Tensor] = None  # [B, T] real-token mask of the next call (None: all real)
        self.empty = True  # nothing written yet: this call attends over its own tokens (see the docstring)
        self._columns: Optional[Tensor] = None
        self._mask: Optional[Tensor] = None
        self._folded: dict[int, Tensor] = {}  # this step's mask folded per group size (built once, every layer)

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch: int, max_len: int) -> "KVCache":
        """A cache shaped for `model` (a DecoderLM), on its device and in its activation dtype."""
        cfg, weight = model.config, model.embed_tokens.weight
        return cls(cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim, weight.device, weight.dtype)

    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def begin_step(self, count: int) -> Tensor:
        """Reserve the next `count` columns; returns the new tokens' RoPE positions [B, count]."""
        device = self.keys.device
        valid = self.next_valid
        self.next_valid = None
        given = valid is not None
        if valid is None:
            valid = torch.ones(self.batch, count, device=device, dtype=torch.bool)
        elif valid.shape != (self.batch, count):
            raise ValueError(f"real-token mask has shape {tuple(valid.shape)}, expected {(self.batch, count)}")
        valid = valid.to(device=device, dtype=torch.bool)
        padded = given and self.empty and not bool(valid.all())  # a host sync, in a prefill only
        columns = self.write_index + torch.arange(count, device=device)
        self.key_valid.index_copy_(1, columns, valid)
        before = valid.long().cumsum(1) - valid.long()  # real tokens earlier in this call; pads do not count
        positions = self.next_position.unsqueeze(1) + before
        self.next_position += valid.long().sum(1)
        self._columns, dtype = columns, self.keys.dtype
        if self.empty:
            self._mask = additive_mask(valid, torch.arange(count, device=device), dtype) if padded else None
        else:
            self._mask = additive_mask(self.key_valid, columns, dtype)
        return positions

    def end_step(self, count: int) -> None:
        self.write_index += count
        self.empty = False
        self._columns = self._mask = None
        self._folded = {}

    def folded_mask(self, group: int) -> Tensor:
        """This step's additive mask folded for `group` query heads per key head (see grouped_attention)."""
        if group not in self._folded:
            self._folded[group] = fold_mask(self._mask, group)
        return self._folded[group]

    def layer(self, index: int) -> "LayerKV":
        return LayerKV(self, index)


class LayerKV:
    """One layer's view of the cache, handed to its attention: stores new keys/values and attends over all."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def attend(self, q_BHTD: Tensor, k_BKTD: Tensor, v_BKTD: Tensor) -> Tensor:
        """Store this call's keys and values, then attention of the new queries over every cached column:
        [B, heads, T, head_dim] (see grouped_attention). On an empty cache, over this call's columns only."""
        keys, values = self.update(k_BKTD, v_BKTD)
        cache, group = self.cache, q_BHTD.shape[1] // keys.shape[1]
        if cache.empty:  # this call's columns are all there is
            keys, values = k_BKTD.to(keys.dtype), v_BKTD.to(values.dtype)
            if cache._mask is None:  # no padding: the training forward's causal call
                return F.scaled_dot_product_attention(q_BHTD, keys, values, is_causal=True, enable_gqa=group > 1)
        return grouped_attention(q_BHTD, keys, values, cache.folded_mask(group))

    def update(self, k_BHTD: Tensor, v_BHTD: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new keys/values; returns all keys and values [B, kv_heads, max_len, head_dim]."""
        cache = self.cache
        if cache._columns is None:
            raise RuntimeError("KVCache.update outside a cached forward (begin_step was not called)")
        keys, values = cache.keys[self.index], cache.values[self.index]
        keys.index_copy_(2, cache._columns, k_BHTD.to(keys.dtype))
        values.index_copy_(2, cache._columns, v_BHTD.to(values.dtype))
        return keys, values


def additive_mask(key_valid_BL: Tensor, columns_T: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, 1, T, L] in `dtype`: 0 where the query in column columns[t] may read key column l (at or before it, and
    a real token or itself), -inf elsewhere."""
    keys = torch.arange(key_valid_BL.shape[1], device=key_valid_BL.device)
    causal = keys <= columns_T.unsqueeze(1)  # [T, L]
    itself = keys == columns_T.unsqueeze(1)
    allowed = causal & (key_valid_BL.unsqueeze(1) | itself)  # [B, T, L]
    bias = torch.zeros(allowed.shape, device=key_valid_BL.device, dtype=dtype)
    return bias.masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def fold_mask(bias_B1TL: Tensor, group: int) -> Tensor:
    """The mask of T query rows repeated for the G query heads of a group: [B, 1, G*T, L] (a view when T = 1)."""
    b, _, t, length = bias_B1TL.shape
    return bias_B1TL.unsqueeze(2).expand(b, 1, group, t, length).reshape(b, 1, group * t, length)


def grouped_attention(q_BHTD: Tensor, k_BKLD: Tensor, v_BKLD: Tensor, folded_bias: Tensor) -> Tensor:
    """Softmax attention of H query heads over K <= H key/value heads (query head h reads key head h // (H/K),
    as SDPA's enable_gqa), under an additive mask broadcast over heads. The G = H/K query heads of a group are
    folded into the query length ([B, K, G*T, D]) so that no key or value is repeated; the mask comes folded
    the same way (`fold_mask`)."""
    b, h, t, d = q_BHTD.shape
    kv_heads = k_BKLD.shape[1]
    q = q_BHTD.reshape(b, kv_heads, (h // kv_heads) * t, d)
    return F.scaled_dot_product_attention(q, k_BKLD, v_BKLD, attn_mask=folded_bias).reshape(b, h, t, d)
