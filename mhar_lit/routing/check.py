"""Check a router against the reference on random routing parameters, forward and backward.

A model's own queries are zero at initialisation, so every routing weight is uniform and a wrong per-head logit,
a wrong softmax or any backward error would pass a comparison of first-batch logits. This check routes one
forward pass over every site of a model's shape with random queries (logits of standard deviation
~LOGIT_STD, so the softmaxes are far from uniform) and random key norms, on a copy of nothing the model owns;
sublayers stand in as `tanh(x * scale_s)` with random per-site scales, so every source differs. It compares the
final site's output and the gradients of a random projection of it with respect to the embedding, the queries and
the key norms.

Tolerance: the router under test and the PyTorch router in the SAME dtype are both compared with a float64 PyTorch
run; the router passes where its error is at most RATIO times the PyTorch router's own error plus a floor (1e-5
of the tensor's largest entry in fp32, 1e-3 in 16-bit dtypes; FLOORS says why). Both compute in fp32 internally and differ by
summation order, so an exact implementation lands near 1x; a wrong head slice or gradient term lands at O(1).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from mhar_lit.routing.factory import make_router

LOGIT_STD = 2.0
RATIO = 2.0
# fp32: the fused kernels' tensor-core products run as tf32x3 (fp32-accurate, not bitwise fp32); on an H100
# (2026-12-06, widths 512 / 1280, H 1-16) they erred up to 2.3x the eager fp32 router's error, at most 1.3e-5 of the
# largest entry. A floor of 1e-5 admits that and stays two orders below a real defect (1e-3 and up).
FLOORS = {torch.float32: 1e-5, torch.float64: 1e-12}
FLOOR_16BIT = 1e-3
CALL_SOURCES = 9  # sources of the one routing call checked in "call" (delta) mode


def random_problem(embedding_BTD: Tensor, sites: int, heads: int, seed: int = 0) -> dict[str, Tensor]:
    """Random routing parameters and stand-in sublayer scales (float64, on the embedding's device)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    d = embedding_BTD.shape[-1]
    b, t, _ = embedding_BTD.shape

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(embedding_BTD.device)

    # a head's logit sums d/H products of a query coordinate with a unit-RMS key: std ~ q_std * sqrt(d/H)
    query_std = LOGIT_STD / (d / heads) ** 0.5
    return {"embedding": embedding_BTD.detach().double(), "query": randn(sites, d) * query_std,
            "norm": 1 + 0.1 * randn(sites, d), "scales": 1 + 0.5 * randn(sites, d), "probe": randn(b, t, d)}


def _run(router, mode: str, problem: dict[str, Tensor], dtype: torch.dtype) -> list[Tensor]:
    """[output, d embedding, d query, d norm] of one pass (float64 copies)."""
    emb, query, norm = (problem[k].to(dtype).detach().requires_grad_() for k in ("embedding", "query", "norm"))
    scales = problem["scales"].to(dtype)
    if mode == "call":
        n = min(CALL_SOURCES, query.shape[0])
        sources = [emb] + [torch.tanh(emb * scales[i]) for i in range(1, n)]
        out = router.route(sources, query[0], norm[0])
    else:
        state = router.begin(emb, query, norm)
        last = query.shape[0] - 1
        for site in range(last):
            state = router.add(state, torch.tanh(router.route(state, site) * scales[site]))
        out = router.route(state, last)
    (out.double() * problem["probe"]).sum().backward()
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (emb, query, norm)]
    return [out.detach().double()] + [g.double() for g in grads]


def _rel(x: Tensor, ref: Tensor) -> float:
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def compare_with_reference(mode: str, backend: str, heads: int, embedding_BTD: Tensor, sites: int,
                           dtype: torch.dtype, eps: float = 1e-6, router_options: Optional[Mapping] = None,
                           kernel_config: Optional[Any] = None, seed: int = 0) -> dict[str, Any]:
    """Errors of `backend`'s router and of the PyTorch router in `dtype` against float64, per compared tensor,
    and whether the router passes (see the module docstring)."""
    options = dict(router_options or {})
    problem = random_problem(embedding_BTD, sites, heads, seed)
    reference = _run(make_router(mode, "torch", heads, eps, **options), mode, problem, torch.float64)
    eager = _run(make_router(mode, "torch", heads, eps, **options), mode, problem, dtype)
    under_test = _run(make_router(mode, backend, heads, eps, kernel_config=kernel_config, **options), mode,
                      problem, dtype)
    floor = FLOORS.get(dtype, FLOOR_16BIT)
    result: dict[str, Any] = {"passed": True, "worst_ratio": 0.0}
    for name, got, base, ref in zip(("output", "grad_embedding", "grad_query", "grad_norm"), under_test, eager,
                                    reference):
        err, err_eager = _rel(got, ref), _rel(base, ref)
        result[f"{name}_rel_err"], result[f"{name}_eager_rel_err"] = err, err_eager
        bound = RATIO * err_eager + floor
        result["worst_ratio"] = max(result["worst_ratio"], err / bound if bound > 0 else float("inf"))
        if not err <= bound:  # `not <=`: NaN fails
            result["passed"] = False
            result.setdefault("failed", []).append(f"{name} {err:.2e} > {RATIO:g} x {err_eager:.2e} + {floor:g}")
    return result
