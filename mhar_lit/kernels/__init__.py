"""Triton kernels for depth routing.

- routing_triton.route_triton: the per-call fused op behind route(..., backend="triton").
- full_routing.FullRouting: chunked cross-site reuse for full mode (one shared source buffer per forward
  pass; used by FullAttnRes when backend="triton").
- block_routing.BlockRouting: block mode over one shared row buffer (used by BlockAttnRes when
  backend="triton").
- launch.launch: the routing kernels' launch path (keeps Triton's compiled kernels, skips its per-call
  binding; MHAR_FAST_LAUNCH=0 turns it off).

Import needs triton; the interpreter (TRITON_INTERPRET=1) must be selected before this package is imported.
"""
