"""Triton kernels for depth routing (used through mhar_lit.routing's triton routers).

Host side, one file per routing op:
- routing_triton.route_triton / route_triton_list: the per-call fused op (a torch.library custom op; delta mode
  and route(..., backend="triton")). Kernels: per_call.py.
- full_routing.FullRouting: chunked cross-site reuse for full mode, one shared source buffer per forward pass.
  Kernels: full_forward.py, full_backward.py.
- block_routing.BlockRouting: block mode over one shared row buffer. Kernels: block.py.
- decode_routing.add / route: full mode while decoding (mhar_lit.generation.routing.DecodeFullRouter), one
  launch per source added and per site routed; kernels in the same file.
Shared: common.py (jit helpers), host.py (checks, tile sizes), tuning.py (FullRoutingConfig, BlockRoutingConfig
and the measured defaults).

Import needs triton; the interpreter (TRITON_INTERPRET=1) must be selected before this package is imported.
"""
