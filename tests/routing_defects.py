"""A router with a known defect, for tests that the router check catches one: the gradient of one input (the
embedding, the queries or the key norms) comes back 1% too large, the rest exact."""

from __future__ import annotations

import torch

DEFECT_INPUTS = ("embedding", "query", "norm")


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class OffByOnePercent:
    """Wraps a depth or call router; `which` (one of DEFECT_INPUTS) gets a gradient 1.01 times the true one."""

    def __init__(self, router, which: str) -> None:
        if which not in DEFECT_INPUTS:
            raise ValueError(f"which must be one of {DEFECT_INPUTS}")
        self.router, self.which = router, which

    def _scaled(self, embedding, query, norm):
        inputs = {"embedding": embedding, "query": query, "norm": norm}
        inputs[self.which] = _ScaleGrad.apply(inputs[self.which], 1.01)
        return inputs["embedding"], inputs["query"], inputs["norm"]

    def begin(self, embedding, query, norm):
        return self.router.begin(*self._scaled(embedding, query, norm))

    def route(self, *args):
        if isinstance(args[0], list):  # call mode: route(sources, query, norm)
            sources, query, norm = args
            embedding, query, norm = self._scaled(sources[0], query, norm)
            return self.router.route([embedding, *sources[1:]], query, norm)
        return self.router.route(*args)

    def add(self, state, output):
        return self.router.add(state, output)
