"""Depth routing for cached decoding (full and call mode): each source normalised once, a few kernels per site.

The reference full router (mhar_lit.routing.torch_routers.FullRouter) stacks every earlier source at every site
and normalises all of them again: at site s that is s + 1 sources, so a pass over 2L + 1 sites copies and
normalises O(L^2) source rows in ~18 kernels per site. In training that is amortised over many tokens; a
decode step routes one token per row, so the step is dominated by those small kernels (and at batch 16 by the
O(L^2) traffic). This router keeps the pass's sources in one preallocated buffer [sites, B, T, D] together with
their normalised keys, each computed once when the source is added:

    add(y_s):    values[s+1] = y_s;  keys[s+1] = round_storage(y_s r(y_s))           (r over the full width)
    route(s):    logit[n, h] = < keys[n]_[h], w_s,[h] >,  w_s = q_s * g_s            (n = 0 .. s)
                 out_[h]     = sum_n softmax_n(logit)[n, h] * values[n]_[h]

About ten kernels per site, and the work per site is linear in its sources. On CUDA the same computation runs
as one Triton launch per site and one per source (mhar_lit.kernels.decode_routing); call mode's softmax and mix
run as one launch after its sources and keys are stacked. Call mode (delta residuals) gets
the same from `DecodeCallRouter`: a delta is routed at every later site of its pass, so its key is computed
the first time and found again by identity; the null source of a site (a parameter row broadcast over the
batch) has its key computed once per decode for all sites. Keys are the reference's rounded
normalised sources (bitwise); folding the key-norm weight g into the query (w = q g, as the block router's
two-phase path does) changes only the fp32 rounding order of the logits. Installed for decoding only
(`mhar_lit.generation.decoding.decode_routing`): it writes into its buffers in place, which autograd must not see.
"""

from __future__ import annotations

import importlib.util
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from mhar_lit.routing import compute_dtype
from mhar_lit.routing.routers import CallRouter, DepthRouter


def normalized_key(source: Tensor, eps: float) -> Tensor:
    """round_storage(S r(S)) in the storage dtype: the reference's rounded normalised source, through
    F.rms_norm (statistic in fp32 for bf16 input; one fused kernel on CUDA where the reference's chain of
    elementwise ops is five). Equal to the reference up to the rounding of x / sqrt(.) vs x * rsqrt(.)."""
    return F.rms_norm(source, (source.shape[-1],), eps=eps)


def decode_kernels_apply(x: Tensor, package: str = "triton") -> bool:
    """Whether Triton kernels (the decode routing's of mhar_lit.kernels.decode_routing, or those of `package`)
    run compiled for tensors like x: CUDA tensors of a 16- or 32-bit float dtype, the package installed, and not
    Triton's interpreter, whose host copies a captured decode step cannot hold."""
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if importlib.util.find_spec(package) is None:
        return False
    from mhar_lit.kernels.host import interpreting

    return not interpreting()


@dataclass(eq=False)
class _DecodeFullState:
    """The pass's sources and their normalised keys ([sites, B, T, D], storage dtype), the folded per-site
    queries w = q g ([sites, H, D/H], compute dtype), the number of sources so far, and whether the Triton
    kernels route it."""

    values: Tensor
    keys: Tensor
    weights: Tensor
    kernels: bool
    count: int = 0


class DecodeFullRouter(DepthRouter):
    """A full-mode router (same contract as the reference FullRouter) for no-grad decoding; see the module
    docstring for the computation. kernels: route on the Triton kernels of mhar_lit.kernels.decode_routing (one
    launch per site and per source instead of about ten); None takes them where decode_kernels_apply says."""

    backend = "torch"

    def __init__(self, heads: int, eps: float, kernels: Optional[bool] = None) -> None:
        super().__init__(heads, eps)
        self.kernels = kernels

    def begin(self, embedding: Tensor, query_SD: Tensor, norm_SD: Tensor) -> _DecodeFullState:
        sites, width = query_SD.shape
        ctype = compute_dtype(embedding.dtype)
        weights = (query_SD.to(ctype) * norm_SD.to(ctype)).view(sites, self.heads, width // self.heads)
        kernels = decode_kernels_apply(embedding) if self.kernels is None else self.kernels
        state = _DecodeFullState(embedding.new_empty((sites, *embedding.shape)),
                                 embedding.new_empty((sites, *embedding.shape)), weights.contiguous(), kernels)
        return self.add(state, embedding)

    def route(self, state: _DecodeFullState, site: int) -> Tensor:
        if state.count != site + 1:
            raise RuntimeError(f"site {site} expected {site + 1} sources, found {state.count}")
        if state.kernels:
            from mhar_lit.kernels import decode_routing

            return decode_routing.route(state.values, state.keys, state.weights[site], state.count)
        n, (_, b, t, d) = state.count, state.values.shape
        heads = self.heads
        keys = state.keys[:n].view(n, b, t, heads, d // heads)
        weights_NBTH = (keys * state.weights[site]).sum(-1).softmax(dim=0)  # bf16 keys promote to fp32 exactly
        values = state.values[:n].view(n, b, t, heads, d // heads)
        mixed_BTHK = (weights_NBTH.unsqueeze(-1) * values).sum(0)
        return mixed_BTHK.reshape(b, t, d).to(state.values.dtype)

    def add(self, state: _DecodeFullState, output: Tensor) -> _DecodeFullState:
        index = state.count
        if index >= state.values.shape[0]:  # the kernel would write past the buffer where indexing would raise
            raise RuntimeError(f"a pass of {state.values.shape[0]} sites has no room for source {index + 1}")
        if state.kernels:
            from mhar_lit.kernels import decode_routing

            decode_routing.add(output, state.values, state.keys, index, self.eps)
        else:
            state.values[index].copy_(output)
            state.keys[index].copy_(normalized_key(state.values[index], self.eps))
        state.count = index + 1
        return state

    def sources(self, state: _DecodeFullState, site: int) -> Tensor:
        return state.values[: site + 1]


class DecodeCallRouter(CallRouter):
    """A call-mode router (same contract as the reference CallRouter) for no-grad decoding: the sources' keys
    are computed once (see the module docstring), the routing itself is a few kernels per site.

    fixed_rows: a parameter [sites, D] whose rows are routed as broadcast sources (DeltaAttnRes.null); their
    keys are computed here once and found by address, which is safe because parameters neither move nor
    change while a decode runs (the router lives for one generate call). kernels: the softmax and the mix in
    one Triton launch (mhar_lit.kernels.decode_routing.route) after the sources and keys are stacked; None
    takes it where decode_kernels_apply says (CUDA, compiled)."""

    backend = "torch"
    _PRUNE_AT = 64  # dead entries of the identity memo are dropped when it grows past this

    def __init__(self, heads: int, eps: float, fixed_rows: Optional[Tensor] = None,
                 kernels: Optional[bool] = None) -> None:
        super().__init__(heads, eps)
        self.kernels = kernels  # None: decode_kernels_apply decides at the first call
        self._known: dict[int, tuple[weakref.ref, Tensor]] = {}  # id(source) -> (the source, weakly; its key)
        self._row_keys: dict[int, Tensor] = {}
        if fixed_rows is not None:
            with torch.no_grad():
                keys = normalized_key(fixed_rows, eps)
            self._row_keys = {fixed_rows[s].data_ptr(): keys[s] for s in range(fixed_rows.shape[0])}

    def route(self, sources: list[Tensor], query: Tensor, norm_weight: Tensor) -> Tensor:
        n, (b, t, d) = len(sources), sources[0].shape
        heads = self.heads
        values = torch.stack(sources) if n > 1 else sources[0].unsqueeze(0)
        keys = torch.stack([self._key(s) for s in sources]) if n > 1 else self._key(sources[0]).unsqueeze(0)
        if self.kernels is None:
            self.kernels = decode_kernels_apply(values)
        if self.kernels:  # one launch for the softmax and the mix (mhar_lit.kernels.decode_routing)
            from mhar_lit.kernels import decode_routing

            head_view = (heads, d // heads)  # the query and its key-norm weight as given, multiplied in the kernel
            return decode_routing.route(values.contiguous(), keys.contiguous(), query.contiguous().view(head_view), n,
                                        norm_weight.contiguous().view(head_view))
        ctype = compute_dtype(values.dtype)
        weights_HK = (query.to(ctype) * norm_weight.to(ctype)).view(heads, d // heads)
        weights_NBTH = (keys.view(n, b, t, heads, d // heads) * weights_HK).sum(-1).softmax(dim=0)
        mixed_BTHK = (weights_NBTH.unsqueeze(-1) * values.view(n, b, t, heads, d // heads)).sum(0)
        return mixed_BTHK.reshape(b, t, d).to(values.dtype)

    def _key(self, source: Tensor) -> Tensor:
        leading = list(zip(source.stride()[:-1], source.shape[:-1]))
        if all(stride == 0 or size == 1 for stride, size in leading):  # one row (broadcast, or a single token)
            row = self._row_keys.get(source.data_ptr())  # only parameter rows are there, never activations
            if row is not None:
                return row.expand_as(source)
        if any(stride == 0 and size > 1 for stride, size in leading):  # a broadcast row: normalise the row only
            return normalized_key(source.reshape(-1, source.shape[-1])[0], self.eps).expand_as(source)
        entry = self._known.get(id(source))
        if entry is not None and entry[0]() is source:
            return entry[1]
        key = normalized_key(source, self.eps)
        if len(self._known) >= self._PRUNE_AT:
            self._known = {k: v for k, v in self._known.items() if v[0]() is not None}
        self._known[id(source)] = (weakref.ref(source), key)
        return key
