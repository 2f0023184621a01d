"""Check a router against the reference on random routing parameters, forward and backward.

A model's own queries are zero at initialisation, so every routing weight is uniform and a wrong per-head logit,
a wrong softmax or any backward error would pass a comparison of first-batch logits. This check routes one
forward pass over every site of a model's shape with random queries (logits of standard deviation ~LOGIT_STD, so
the softmaxes are far from uniform) and random key norms; sublayers stand in as `tanh(x * scale_s)` with random
per-site scales, so every source differs, and the final site's output is projected on a random tensor.

Every router sees the same inputs. The stand-in sublayer outputs are taken from a float64 pass and rounded to the
dtype under test, and fed to every router in the forward; in the backward, the gradient that reaches each of
them is replaced by the float64 pass's gradient there, rounded likewise (`_Forced`). The router under test, the
PyTorch router in the same dtype ("eager") and a float64 PyTorch router on those rounded inputs (the reference)
therefore differ only by their own arithmetic at each site, not by rounding differences carried from site to site.
Compared per tensor, by relative L2 error against the reference: every site's output, the gradient each router
returns for every source, and the gradients of the embedding, the queries and the key norms. A router passes where
its error is at most RATIO times eager's plus a floor (FLOORS).

Why forced inputs (measured in docs/routing.md): with each router running its own chain, bf16 rounding at one
site changes every later site's inputs, so two correct routers' gradients sit 0.5-1% apart from the float64
reference and from each other; the largest-entry error of that comparison scattered 2-3x between a correct kernel
and eager PyTorch (false alarms), while a gradient 1% off moved it by less than that scatter (missed defects).
Forced, a correct bf16 router's errors are its own roundings (~1e-3), and a gradient 1% off is ~10x that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from mhar_lit.routing.factory import make_router

LOGIT_STD = 2.0
RATIO = 2.0
# fp32: the fused kernels' tensor-core products run as tf32x3 (fp32-accurate, not bitwise fp32); 16-bit: one
# rounding of a result is 2^-9 relative (L2 ~1e-3 over a tensor). The floors admit that and stay an order below
# a gradient 1% off.
FLOORS = {torch.float32: 1e-5, torch.float64: 1e-12}
FLOOR_16BIT = 1e-3
CALL_SOURCES = 9  # sources of the one routing call checked in "call" (delta) mode
COMPARED = ("outputs", "grad_sources", "grad_embedding", "grad_query", "grad_norm")


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


@dataclass
class _Forcing:
    """The stand-in sources' values and the gradients that reach them, from the float64 pass (rounded to the
    dtype under test), and the gradients each router returned for them (`seen`)."""

    values: Optional[list[Tensor]] = None
    grads: Optional[list[Tensor]] = None
    seen: dict[int, Tensor] = field(default_factory=dict)


class _Forced(torch.autograd.Function):
    """Forward: the common value of source `index`. Backward: records the router's gradient for it and passes the
    common gradient on, so every site's backward starts from the same upstream gradient."""

    @staticmethod
    def forward(ctx, own: Tensor, index: int, forcing: _Forcing) -> Tensor:
        ctx.index, ctx.forcing = index, forcing
        return forcing.values[index].to(own.dtype).clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.forcing.seen[ctx.index] = grad.detach()
        return ctx.forcing.grads[ctx.index].to(grad.dtype), None, None


def _feed(own: Tensor, index: int, forcing: _Forcing) -> Tensor:
    if forcing.values is None:  # the float64 pass that defines the common values: record them
        own.retain_grad()
        forcing.seen[index] = own
        return own
    return _Forced.apply(own, index, forcing)


def _run(router, mode: str, problem: dict[str, Tensor], dtype: torch.dtype, inputs_dtype: torch.dtype,
         forcing: _Forcing) -> dict[str, Tensor]:
    """The compared tensors (float64 copies) of one pass in `dtype` on the problem's values rounded to
    `inputs_dtype`."""
    emb, query, norm = (problem[k].to(inputs_dtype).to(dtype).detach().requires_grad_()
                        for k in ("embedding", "query", "norm"))
    scales = problem["scales"].to(inputs_dtype).to(dtype)
    if mode == "call":  # one routing call: its sources are leaves, the same values for every router
        n = min(CALL_SOURCES, query.shape[0])
        base = problem["embedding"].to(inputs_dtype).double()
        leaves = [torch.tanh(base * problem["scales"][i].to(inputs_dtype).double()).to(inputs_dtype).to(dtype)
                  .requires_grad_() for i in range(1, n)]
        forcing.seen = dict(enumerate(leaves))
        outputs = [router.route([emb, *leaves], query[0], norm[0])]
    else:
        state, outputs = router.begin(emb, query, norm), []
        for site in range(query.shape[0] - 1):
            outputs.append(router.route(state, site))
            state = router.add(state, _feed(torch.tanh(outputs[-1] * scales[site]), site, forcing))
        outputs.append(router.route(state, query.shape[0] - 1))
    (outputs[-1].double() * problem["probe"]).sum().backward()
    seen = [forcing.seen[i] for i in sorted(forcing.seen)]
    seen = [s.grad if s.requires_grad else s for s in seen]  # recorded tensors (float64 pass, call mode) or grads
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (emb, query, norm)]
    return {"outputs": torch.stack([o.detach().double() for o in outputs]),
            "grad_sources": torch.stack([s.double() for s in seen]) if seen else emb.new_zeros(1).double(),
            "grad_embedding": grads[0].double(), "grad_query": grads[1].double(), "grad_norm": grads[2].double()}


def _common_forcing(mode: str, problem: dict[str, Tensor], heads: int, eps: float, options: Mapping,
                    dtype: torch.dtype) -> _Forcing:
    """The float64 pass on inputs rounded to `dtype`: its stand-in source values and their gradients."""
    if mode == "call":
        return _Forcing()
    record = _Forcing()
    _run(make_router(mode, "torch", heads, eps, **options), mode, problem, torch.float64, dtype, record)
    sources = [record.seen[i] for i in sorted(record.seen)]
    return _Forcing(values=[s.detach().to(dtype) for s in sources], grads=[s.grad.to(dtype) for s in sources])


def errors(got: Tensor, ref: Tensor) -> dict[str, float]:
    """Relative errors of `got` against `ref`: of the largest entry ("max"), of the whole tensor ("l2"), and the
    error's component along `ref` ("scale": 0.01 for `got` = 1.01 `ref`; rounding noise, uncorrelated with `ref`,
    adds ~l2 / sqrt(numel) to it)."""
    diff, norm = got - ref, ref.norm().clamp_min(1e-30)
    return {"max": (diff.abs().max() / ref.abs().max().clamp_min(1e-30)).item(), "l2": (diff.norm() / norm).item(),
            "scale": ((diff * ref).sum() / norm**2).item()}


def runs(mode: str, backend: str, heads: int, embedding_BTD: Tensor, sites: int, dtype: torch.dtype,
         eps: float = 1e-6, router_options: Optional[Mapping] = None, kernel_config: Optional[Any] = None,
         seed: int = 0, under_test: Optional[Any] = None) -> tuple[dict, dict, dict]:
    """The compared tensors (COMPARED) of the float64 reference, the PyTorch router in `dtype` and `backend`'s
    router in `dtype` (or the router instance `under_test`) on one random problem, every router on the same
    inputs (module docstring)."""
    options = dict(router_options or {})
    problem = random_problem(embedding_BTD, sites, heads, seed)
    forcing = _common_forcing(mode, problem, heads, eps, options, dtype)

    def run(router, run_dtype):
        forcing.seen = {}
        return _run(router, mode, problem, run_dtype, dtype, forcing)

    reference = run(make_router(mode, "torch", heads, eps, **options), torch.float64)
    eager = run(make_router(mode, "torch", heads, eps, **options), dtype)
    if under_test is None:
        under_test = make_router(mode, backend, heads, eps, kernel_config=kernel_config, **options)
    return reference, eager, run(under_test, dtype)


def compare_with_reference(mode: str, backend: str, heads: int, embedding_BTD: Tensor, sites: int,
                           dtype: torch.dtype, eps: float = 1e-6, router_options: Optional[Mapping] = None,
                           kernel_config: Optional[Any] = None, seed: int = 0,
                           under_test: Optional[Any] = None) -> dict[str, Any]:
    """Errors of `backend`'s router (or of the router instance `under_test`) and of the PyTorch router in `dtype`
    against float64, per compared tensor, and whether the router passes (see the module docstring)."""
    reference, eager, tested = runs(mode, backend, heads, embedding_BTD, sites, dtype, eps, router_options,
                                    kernel_config, seed, under_test)
    floor = FLOORS.get(dtype, FLOOR_16BIT)
    result: dict[str, Any] = {"passed": True, "worst_ratio": 0.0}
    for name in COMPARED:
        got, base = errors(tested[name], reference[name]), errors(eager[name], reference[name])
        for measure, label in (("l2", ""), ("scale", " scale")):
            err, err_eager = abs(got[measure]), abs(base[measure])
            result[f"{name}{label.replace(' ', '_')}_rel_err"] = err
            result[f"{name}{label.replace(' ', '_')}_eager_rel_err"] = err_eager
            bound = RATIO * err_eager + floor
            result["worst_ratio"] = max(result["worst_ratio"], err / bound if bound > 0 else float("inf"))
            if not err <= bound:  # `not <=`: NaN fails
                result["passed"] = False
                result.setdefault("failed", []).append(
                    f"{name}{label} {err:.2e} > {RATIO:g} x {err_eager:.2e} + {floor:g}")
    return result
