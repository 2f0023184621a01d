"""Delta attention residuals: identity-preserving MHAR for converting pretrained models (docs/method.md E).

The additive stream h stays intact; routing only changes what each sublayer reads, through a scalar
gate a_s per site that starts at 0, so the converted model is bit-for-bit the pretrained one at init:

    h = embedding;  deltas = []
    site s of layer l:
        x_s = h + a_s * route([z_s] + deltas; q_s, g_s, H)     z_s: learnable null source (zeros)
        if s is the attention site of a block-start layer (l % P == 0):
            deltas.append(h - h_prev_boundary);  h_prev_boundary = h      (e_0 = embedding)
        y_s = sublayer_s(norm(x_s));   h <- h + y_s
    final: h  (no final routing site)

The delta of a block is appended after the block-start layer's attention has routed, so that site sees
one source fewer than its MLP site; layer-0 attention sees only the null source. With L = 32, P = 4 a site
sees at most 8 deltas + null = 9 sources. `legacy_block_delta=True` reproduces the authors' released
bookkeeping (e_j = h - e_{j-1}, telescoping mixtures, docs/method.md J4) for evaluating their checkpoint.

Identity comes from a_s = 0 alone (not from the null source): q, g and z get zero gradient at step 0,
a_s gets <dL/dx_s, mix_s>. Parameters per layer: q, g, z of width d for 2 sites plus 2 gates = 6d + 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

from mhar_lit.config import ModelConfig
from mhar_lit.residual.attnres import RoutedResidual
from mhar_lit.residual.base import is_attention_site, layer_of
from mhar_lit.routing.routers import register_state_pytree


@dataclass(eq=False)
class _DeltaState:
    """The residual stream, the block deltas so far and the last boundary state (legacy: the last delta).

    A dataclass and a pytree node, so that module-output hooks (FSDP's pre-backward all-gather) find its
    tensors when a DecoderLayer returns it."""

    stream: Tensor
    deltas: list[Tensor] = field(default_factory=list)
    previous: Optional[Tensor] = None


register_state_pytree(_DeltaState, ("stream", "deltas", "previous"))


class DeltaAttnRes(RoutedResidual):
    """Gated MHAR over a null source and block deltas, added to the untouched residual stream (a "call"
    router: one routing call per site over the listed sources)."""

    routing_mode = "call"
    label_options = ("heads", "layers_per_block")
    preserves_pretrained_function = True

    def __init__(self, heads: int = 8, layers_per_block: int = 4, null_source: bool = True,
                 legacy_block_delta: bool = False, eps: float = 1e-6) -> None:
        super().__init__(heads=heads, random_query_init=False, eps=eps)
        if layers_per_block < 1:
            raise ValueError(f"layers_per_block must be >= 1, got {layers_per_block}")
        self.layers_per_block = layers_per_block
        self.null_source = null_source
        self.legacy_block_delta = legacy_block_delta

    def num_routing_sites(self, config: ModelConfig) -> int:
        return 2 * config.num_layers  # no final site

    def build(self, config: ModelConfig) -> None:
        if config.num_layers % self.layers_per_block != 0:
            raise ValueError(
                f"num_layers {config.num_layers} is not divisible by layers_per_block {self.layers_per_block}"
            )
        super().build(config)
        sites = self.num_routing_sites(config)
        # Shape (sites, 1), not (sites,): FSDP flattening rejects 0-dim parameters if these are ever split.
        self.gate = nn.Parameter(torch.empty(sites, 1))
        self.null = nn.Parameter(torch.empty(sites, config.hidden_size)) if self.null_source else None

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            self.gate.zero_()
            if self.null is not None:
                self.null.zero_()

    def no_decay_parameter_names(self) -> set[str]:
        return {"key_norm", "gate", "null"}

    def begin(self, embedding: Tensor) -> _DeltaState:
        return _DeltaState(embedding)

    def sublayer_input(self, state: _DeltaState, site: int) -> Tensor:
        h = state.stream
        sources = list(state.deltas)
        if self.null is not None:
            sources.insert(0, self.null[site].to(h.dtype).expand_as(h))
        x = h + self.gate[site].to(h.dtype) * self.route_sources(sources, site) if sources else h
        layer = layer_of(site)
        if is_attention_site(site) and layer % self.layers_per_block == 0:
            self._append_block_delta(state)
        return x

    def _append_block_delta(self, state: _DeltaState) -> None:
        h = state.stream
        delta = h if state.previous is None else h - state.previous
        state.deltas.append(delta)
        state.previous = delta if self.legacy_block_delta else h

    def sublayer_output(self, state: _DeltaState, site: int, output: Tensor) -> _DeltaState:
        state.stream = state.stream + output
        return state

    def final(self, state: _DeltaState) -> Tensor:
        return state.stream
