"""Attention residuals over depth: single-head (Kimi, arXiv 2603.15031) and multi-head MHAR (Luo, Cai, Hu 2026).

Full mode (docs/method.md B, C). No additive stream: every sublayer reads a learned softmax mixture of the
embedding and all earlier raw sublayer outputs, per head slice:

    S_0 = embedding                       sources: S_0, S_1 = y_0, S_2 = y_1, ...
    x_s = route(S_0..S_s; q_s, g_s, H)    site s = 0 .. 2L-1 sees s+1 sources
    y_s = sublayer_s(norm(x_s));  S_{s+1} = y_s
    final: route(S_0..S_2L; q_2L, g_2L)   a (2L+1)-th site before the final norm

Block mode (docs/method.md D, Kimi's Block AttnRes). Blocks of `layers_per_block` layers; inside a block the
outputs are summed into a partial p, across blocks the sublayers route over completed block sums:

    sources at a site = [embedding, B_1, ..., B_{n-1}] + ([p] if the block has produced anything)
    y = sublayer(norm(x));  p <- p + y;  at a block boundary B_n <- p, p <- nothing

Every site s has a query q_s (zero-initialised: uniform mixing at init) and a key-norm weight g_s (ones),
both of width d, so the method adds (2L+1) * 2d parameters whatever the number of heads H.

The routing itself is a router of mhar_lit.routing (make_router): the strategies never look at the backend.
It is "torch" (the reference) until set_routing_backend picks another (the RoutingBackend callback does, or
library code).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import Tensor, nn

from mhar_lit.config import ModelConfig
from mhar_lit.residual.base import ResidualStrategy
from mhar_lit.routing import check_heads, make_router


class RoutedResidual(ResidualStrategy):
    """Shared machinery: per-site (query, key_norm) parameters and a router (`routing_mode`: "full", "block"
    or "call"; see mhar_lit.routing).

    Two options beyond the paper (docs/method.md "Beyond the paper: routing learning rate"), off by default:
    logit_scale, a constant c multiplying every routing logit: None (the paper, c = 1), a positive number,
    "sqrt_heads" (c = sqrt(H)) or "heads" (c = H). The logits are linear in the query, so the router is given
    c * query (`effective_query`) and no kernel changes: both backends agree, and autograd carries c into the
    query's gradient. routing_lr_scale: the queries (`routing_parameters`) get their own AdamW group with
    lr x this factor, on the same schedule (1.0: no extra group, the paper's optimiser).
    """

    routing_mode = "full"
    label_options = ("heads",)

    def __init__(self, heads: int = 8, random_query_init: bool = False, eps: float = 1e-6,
                 logit_scale: Union[None, float, str] = None, routing_lr_scale: float = 1.0) -> None:
        super().__init__()
        if heads < 1:
            raise ValueError(f"heads must be >= 1, got {heads}")
        if isinstance(routing_lr_scale, bool) or not (isinstance(routing_lr_scale, (int, float))
                                                      and math.isfinite(routing_lr_scale) and routing_lr_scale > 0):
            raise ValueError(f"routing_lr_scale must be a positive number, got {routing_lr_scale!r}")
        self.heads = heads
        self.random_query_init = random_query_init
        self.eps = eps
        self.logit_factor = resolve_logit_scale(logit_scale, heads)
        # numbers as floats, so that 8 and 8.0 are one method in labels and identities
        self.logit_scale = logit_scale if logit_scale is None or isinstance(logit_scale, str) else self.logit_factor
        self.routing_lr_scale = float(routing_lr_scale)
        # called with (site, sources [N, B, T, D], detached) at every routing site (mhar_lit.analysis.capture)
        self.source_observer: Optional[Callable[[int, Tensor], None]] = None
        self._routing_choice: tuple[str, Optional[Mapping]] = ("torch", None)
        self._router = None

    def set_routing_backend(self, backend: str, kernel_config: Optional[Mapping | Any] = None) -> None:
        """Route with `backend` ("torch" or "triton") from now on; kernel_config: the triton router's kernel
        tuning (a FullRoutingConfig / BlockRoutingConfig or a mapping of its fields; None: measured defaults)."""
        router = make_router(self.routing_mode, backend, self.heads, self.eps, kernel_config=kernel_config,
                             **self.router_options())
        self._routing_choice, self._router = (backend, kernel_config), router

    @property
    def backend(self) -> str:
        """The routing backend in use ("torch" until set_routing_backend picks another)."""
        return self._routing_choice[0]

    @property
    def routing_choice(self) -> tuple[str, Optional[Mapping | Any]]:
        """(backend, kernel_config) as last given to set_routing_backend."""
        return self._routing_choice

    @property
    def router(self):
        if self._router is None:
            self.set_routing_backend(*self._routing_choice)
        return self._router

    def router_options(self) -> dict:
        """Mode options of this strategy's router (block mode: span, two_phase)."""
        return {}

    def effective_query(self) -> Tensor:
        """The queries [sites, D] the router is given: the parameter itself at logit scale 1 (the paper's
        computation, bit for bit), else logit_factor * query. Monitors and the probe compute weights from it."""
        if self.logit_factor == 1.0:
            return self.query
        return self.query * self.logit_factor

    def num_routing_sites(self, config: ModelConfig) -> int:
        return 2 * config.num_layers + 1

    def build(self, config: ModelConfig) -> None:
        check_heads(config.hidden_size, self.heads)
        sites, width = self.num_routing_sites(config), config.hidden_size
        self.query = nn.Parameter(torch.empty(sites, width))
        self.key_norm = nn.Parameter(torch.empty(sites, width))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.random_query_init:  # the legacy [P1] init, kept for ablations
                nn.init.normal_(self.query, std=self.model_config.init_std)
            else:
                self.query.zero_()
            self.key_norm.fill_(1.0)

    def no_decay_parameter_names(self) -> set[str]:
        return {"key_norm"}

    def routing_parameters(self) -> list[nn.Parameter]:
        return [self.query]

    # ---- full and block mode: the router keeps the depth state
    def begin(self, embedding: Tensor) -> Any:
        return self.router.begin(embedding, self.effective_query(), self.key_norm)

    def sublayer_input(self, state: Any, site: int) -> Tensor:
        return self.route_site(state, site)

    def sublayer_output(self, state: Any, site: int, output: Tensor) -> Any:
        return self.router.add(state, output)

    def final(self, state: Any) -> Tensor:
        return self.route_site(state, self.final_site)

    def route_site(self, state: Any, site: int) -> Tensor:
        mixed = self.router.route(state, site)
        if self.source_observer is not None:
            self.source_observer(site, self.router.sources(state, site).detach())
        return mixed

    # ---- call mode (delta): one routing call over a list of sources
    def route_sources(self, sources: list[Tensor], site: int) -> Tensor:
        if self.source_observer is not None:
            self.source_observer(site, torch.stack(sources).detach())
        return self.router.route(sources, self.effective_query()[site], self.key_norm[site])

    @property
    def final_site(self) -> int:
        return 2 * self.model_config.num_layers


def resolve_logit_scale(logit_scale: Union[None, float, str], heads: int) -> float:
    """The factor c of a `logit_scale` setting (see RoutedResidual); a clear error for anything else."""
    named = {"sqrt_heads": math.sqrt(heads), "heads": float(heads)}
    if logit_scale is None:
        return 1.0
    if isinstance(logit_scale, str):
        if logit_scale not in named:
            raise ValueError(f"logit_scale must be null, a positive number, 'sqrt_heads' or 'heads', got {logit_scale!r}")
        return named[logit_scale]
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)) or not (
            math.isfinite(logit_scale) and logit_scale > 0):
        raise ValueError(f"logit_scale must be null, a positive number, 'sqrt_heads' or 'heads', got {logit_scale!r}")
    return float(logit_scale)


class FullAttnRes(RoutedResidual):
    """Full attention residuals over the embedding and every raw sublayer output. heads=1: single-head.

    On the triton backend the router needs every site exactly once per forward pass and the backward in
    reverse order (mhar_lit.routing); activation checkpointing that recomputes routing raises a RuntimeError
    there (checkpointing sublayers is fine).
    """


class BlockAttnRes(RoutedResidual):
    """Block attention residuals: additive inside blocks of layers, routed across blocks.

    The blocks tile the depth exactly (no ceil rule). Give their size or an upper bound on their count:
    layers_per_block (a depth that is not a multiple of it is a ValueError naming both numbers), or num_blocks,
    the most equal blocks not more than num_blocks: the largest divisor of the depth up to num_blocks, so one
    setting fits every size (num_blocks 8: 6 blocks of 2 layers at depth 12, 8 of 3 at 24, 6 of 6 at 36,
    where the paper's ceil rule would leave a 1-layer last block; docs/method.md J6). Neither: 2 layers per block.

    two_phase=True computes the same routing as Kimi's two-phase refactoring on the torch backend (see
    mhar_lit.routing.torch_routers.BlockRouter; measured in benchmarks/results/cpu_two_phase_2026-12-05); the
    triton backend has its own fused schedule and ignores it (with a warning).
    """

    routing_mode = "block"
    label_options = ("heads", "layers_per_block", "num_blocks")
    speed_options = frozenset({"two_phase"})

    def __init__(self, heads: int = 8, layers_per_block: Optional[int] = None, num_blocks: Optional[int] = None,
                 random_query_init: bool = False, eps: float = 1e-6, two_phase: bool = False,
                 logit_scale: Union[None, float, str] = None, routing_lr_scale: float = 1.0) -> None:
        super().__init__(heads=heads, random_query_init=random_query_init, eps=eps, logit_scale=logit_scale,
                         routing_lr_scale=routing_lr_scale)
        if layers_per_block is not None and num_blocks is not None:
            raise ValueError(f"give layers_per_block or num_blocks, not both (got {layers_per_block} and {num_blocks})")
        for name, value in (("layers_per_block", layers_per_block), ("num_blocks", num_blocks)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.layers_per_block = layers_per_block
        self.num_blocks = num_blocks
        self.two_phase = two_phase
        # layers per block; with num_blocks known only once build() sees the depth
        self.block_layers = layers_per_block or (2 if num_blocks is None else None)

    def router_options(self) -> dict:
        if self.block_layers is None:
            raise RuntimeError("BlockAttnRes(num_blocks=...) routes once bound to a model: its block size depends "
                               "on the depth")
        return {"span": 2 * self.block_layers, "two_phase": self.two_phase}

    def build(self, config: ModelConfig) -> None:
        self.block_layers = self.resolve_block_layers(config.num_layers)
        super().build(config)

    def resolve_block_layers(self, num_layers: int) -> int:
        """Layers per block at this depth (see the class docstring)."""
        if self.num_blocks is not None:
            blocks = max(b for b in range(1, min(self.num_blocks, num_layers) + 1) if num_layers % b == 0)
            return num_layers // blocks
        layers = self.layers_per_block or 2
        if num_layers % layers != 0:
            raise ValueError(f"num_layers {num_layers} is not divisible by layers_per_block {layers}")
        return layers
