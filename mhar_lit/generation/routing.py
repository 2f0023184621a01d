"""Full-mode depth routing for cached decoding: each source normalised once, a few kernels per site.

The reference full router (mhar_lit.routing.torch_routers.FullRouter) stacks every earlier source at every site
and normalises all of them again: at site s that is s + 1 sources, so a pass over 2L + 1 sites copies and
normalises O(L^2) source rows in ~18 kernels per site. In training that is amortised over many tokens; a
decode step routes one token per row, so the step is dominated by those small kernels (and at batch 16 by the
O(L^2) traffic). This router keeps the pass's sources in one preallocated buffer [sites, B, T, D] together with
their normalised keys, each computed once when the source is added:

    add(y_s):    values[s+1] = y_s;  keys[s+1] = round_storage(y_s r(y_s))           (r over the full width)
    route(s):    logit[n, h] = < keys[n]_[h], w_s,[h] >,  w_s = q_s * g_s            (n = 0 .. s)
                 out_[h]     = sum_n softmax_n(logit)[n, h] * values[n]_[h]

About six kernels per site, and the work per site is linear in its sources. Keys are the reference's rounded
normalised sources (bitwise); folding the key-norm weight g into the query (w = q g, as the block router's
two-phase path does) changes only the fp32 rounding order of the logits. Installed for decoding only
(`mhar_lit.generation.decoding.decode_routing`): it writes into its buffers in place, which autograd must not see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mhar_lit.routing import compute_dtype
from mhar_lit.routing.routers import DepthRouter


@dataclass(eq=False)
class _DecodeFullState:
    """The pass's sources and their normalised keys ([sites, B, T, D], storage dtype), the folded per-site
    queries w = q g ([sites, H, D/H], compute dtype) and the number of sources so far."""

    values: Tensor
    keys: Tensor
    weights: Tensor
    count: int = 0


class DecodeFullRouter(DepthRouter):
    """A full-mode router (same contract as the reference FullRouter) for no-grad decoding; see the module
    docstring for the computation."""

    backend = "torch"

    def begin(self, embedding: Tensor, query_SD: Tensor, norm_SD: Tensor) -> _DecodeFullState:
        sites, width = query_SD.shape
        ctype = compute_dtype(embedding.dtype)
        weights = (query_SD.to(ctype) * norm_SD.to(ctype)).view(sites, self.heads, width // self.heads)
        state = _DecodeFullState(embedding.new_empty((sites, *embedding.shape)),
                                 embedding.new_empty((sites, *embedding.shape)), weights)
        return self.add(state, embedding)

    def route(self, state: _DecodeFullState, site: int) -> Tensor:
        if state.count != site + 1:
            raise RuntimeError(f"site {site} expected {site + 1} sources, found {state.count}")
        n, (_, b, t, d) = state.count, state.values.shape
        heads = self.heads
        keys = state.keys[:n].view(n, b, t, heads, d // heads)
        weights_NBTH = (keys * state.weights[site]).sum(-1).softmax(dim=0)  # bf16 keys promote to fp32 exactly
        values = state.values[:n].view(n, b, t, heads, d // heads)
        mixed_BTHK = (weights_NBTH.unsqueeze(-1) * values).sum(0)
        return mixed_BTHK.reshape(b, t, d).to(state.values.dtype)

    def add(self, state: _DecodeFullState, output: Tensor) -> _DecodeFullState:
        index = state.count
        state.values[index].copy_(output)
        source = state.values[index]
        v = source.to(compute_dtype(source.dtype))
        state.keys[index].copy_(v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps))  # rounds to storage
        state.count = index + 1
        return state

    def sources(self, state: _DecodeFullState, site: int) -> Tensor:
        return state.values[: site + 1]
