"""The fused routing on a real GPU at the widths users train: full, block and call (delta) mode, H in {1, 2, 4, 8, 16},
fp32 and bf16, at the 100M (d 512, 12 layers), 1B (d 1280, 36 layers) and 8B (d 4096, 32 layers) shapes.

Each case routes one forward pass over every site (sublayers stand in as cheap elementwise maps with random
per-site scales, so the sources differ) and a backward from a random projection of the final site, on the
triton router and on the torch router in the same dtype, with float64 torch as the reference. No configuration may
crash: a shape the kernels cannot run must be refused with a clear error before training, and there is none today.

Tolerance: the fused kernels accumulate in fp32 in another order than the reference, so each output and gradient
is held to the error the torch router in the SAME dtype makes against float64, times 2, plus a floor of 1e-6 (fp32)
or 1e-3 (bf16) relative to the tensor's largest entry: being as accurate as eager PyTorch is the claim.
CUDA only (skipped on CPU machines; the interpreter covers the kernels' math at small widths in tests/kernels).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from mhar_lit.routing import make_router

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the fused kernels at "
                                "real widths); tests/kernels covers them in the Triton interpreter")

WIDTHS = {"100M": (512, 12), "1B": (1280, 36), "8B": (4096, 32)}
TOKENS = (1, 256)  # B, T: the kernels tile tokens; the width, heads and depth set the tile shapes


def _problem(width: int, sites: int, gen: torch.Generator):
    b, t = TOKENS
    emb = torch.randn(b, t, width, generator=gen, dtype=torch.float64)
    query = torch.randn(sites, width, generator=gen, dtype=torch.float64) * 0.5  # non-uniform routing
    norm = 1 + 0.1 * torch.randn(sites, width, generator=gen, dtype=torch.float64)
    scales = 1 + 0.5 * torch.randn(sites, width, generator=gen, dtype=torch.float64)
    probe = torch.randn(b, t, width, generator=gen, dtype=torch.float64)
    return emb, query, norm, scales, probe


def _depth_pass(mode: str, backend: str, heads: int, span: int, dtype, problem):
    """Outputs of one pass over every site and the gradients of <final, probe> w.r.t. embedding, query, norm."""
    emb, query, norm, scales, probe = (x.cuda() for x in problem)
    emb, query, norm = (x.to(dtype).detach().requires_grad_() for x in (emb, query, norm))
    router = make_router(mode, backend, heads, span=span)
    state = router.begin(emb, query, norm)
    sites = query.shape[0]
    for site in range(sites - 1):
        x = router.route(state, site)
        state = router.add(state, torch.tanh(x * scales[site].to(dtype)))
    final = router.route(state, sites - 1)
    (final.double() * probe).sum().backward()
    return [final.detach().double(), emb.grad.double(), query.grad.double(), norm.grad.double()]


def _call_pass(backend: str, heads: int, dtype, problem):
    """One routing call over all sources (delta mode's router) and its gradients."""
    emb, query, norm, scales, probe = (x.cuda() for x in problem)
    sources = [torch.tanh(emb * s) for s in scales]
    sources = [s.to(dtype).detach().requires_grad_() for s in sources]
    q, g = (x[0].to(dtype).detach().requires_grad_() for x in (query, norm))
    out = make_router("call", backend, heads).route(sources, q, g)
    (out.double() * probe).sum().backward()
    return [out.detach().double(), q.grad.double(), g.grad.double(), *(s.grad.double() for s in sources[:3])]


def _run(mode, backend, heads, span, dtype, problem):
    if mode == "call":
        return _call_pass(backend, heads, dtype, problem)
    return _depth_pass(mode, backend, heads, span, dtype, problem)


def _err(x, ref):
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", list(WIDTHS))
@pytest.mark.parametrize("mode", ["full", "block", "call"])
@pytest.mark.parametrize("heads", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_routing_runs_and_matches_the_reference(shape, mode, heads, dtype):
    """Every (width, mode, heads, dtype) runs forward and backward on the GPU, as accurate as eager PyTorch."""
    width, layers = WIDTHS[shape]
    sites = 2 * layers + 1 if mode != "call" else min(2 * layers + 1, 25)
    span = 4 if mode == "block" else 0  # two layers per block, as the shipped block configs
    gen = torch.Generator().manual_seed(zlib.crc32(f"{shape}-{mode}-{heads}-{dtype}".encode()))
    problem = _problem(width, sites, gen)
    reference = _run(mode, "torch", heads, span, torch.float64, problem)
    eager = _run(mode, "torch", heads, span, dtype, problem)
    fused = _run(mode, "triton", heads, span, dtype, problem)
    floor = 1e-6 if dtype == torch.float32 else 1e-3
    names = ["output", "grad 0", "grad 1", "grad 2", "grad 3", "grad 4"]
    for name, got, base, ref in zip(names, fused, eager, reference):
        bound = 2 * _err(base, ref) + floor
        assert _err(got, ref) <= bound, f"{name}: fused {_err(got, ref):.2e} vs eager {_err(base, ref):.2e}"
