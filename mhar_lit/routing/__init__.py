"""Depth routing: the reference math (reference.py) and one router per mode and backend (routers.py: interfaces; torch_routers.py, triton_routers.py; factory.py).

Every attention-residual strategy reaches routing through a router made by `make_router(mode, backend, ...)`
and never looks at the backend itself; the backend is chosen in one place (the RoutingBackend callback, or
`strategy.set_routing_backend(...)` in library use). Modes:

    "full"   sites 0..n-1 route over the embedding and every earlier sublayer output (docs/method.md B, C)
    "block"  sites route over completed block sums plus the block's partial sum (docs/method.md D)
    "call"   one routing call over a given list of sources (delta mode, docs/method.md E)

Full and block routers (a DepthRouter) keep the depth state of one forward pass:

    state = router.begin(embedding, query_SD, norm_SD)   embedding [B, T, D]; query, key norm [sites, D]
    x_s   = router.route(state, s)                       the input of site s (s = 0 .. n-1, n = sites)
    state = router.add(state, y_s)                        the output of the sublayer at site s
    S     = router.sources(state, s)                      [N, B, T, D] sources of site s, right after route
                                                          (for the routing monitor; a copy on triton)

Order contract: within one forward pass every site is routed exactly once, in order, each followed by `add`
of its sublayer's output (the final site n-1 has none); the backward visits the sites in reverse order
(autograd does this, since every site's output feeds the next site's source). The triton routers rely on it
and raise where it breaks (e.g. activation checkpointing that recomputes routing); the torch routers keep
plain lists of tensors and allow recomputation.

Call routers: `router.route(sources, query, norm_weight)` with sources a list of N [B, T, D] tensors and
query, norm_weight [D] -> [B, T, D].

`route(sources, query, norm_weight, heads, eps, backend)` is the public per-call function on a stacked
[N, B, T, D] tensor.
"""

from mhar_lit.routing.reference import (block_mix, check_heads, compute_dtype, merge_partial, normalized_sources,
                                        route_reference, routing_keys, routing_logits, routing_weights)
from mhar_lit.routing.factory import make_router
from mhar_lit.routing.routers import BACKENDS, MODES, CallRouter, DepthRouter, route

__all__ = [
    "BACKENDS", "MODES", "CallRouter", "DepthRouter", "make_router", "route",
    "block_mix", "check_heads", "compute_dtype", "merge_partial", "normalized_sources", "route_reference",
    "routing_keys", "routing_logits", "routing_weights",
]
