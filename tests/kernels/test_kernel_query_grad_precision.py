"""bf16 accuracy of the Triton routers' (full, block and per-call) query and key-norm gradients against eager
PyTorch's, through the router check (mhar_lit.routing.check) in the interpreter. The backward takes
S = <dout, out> from the output rounded to bf16; unless dl is projected before dq/dg (common._projected_dl),
grad_query and grad_norm are 3-5x less accurate than eager's (which has S in fp32) while every other compared
tensor is as accurate."""

import pytest
import torch

from mhar_lit.routing.check import FLOOR_16BIT, RATIO, compare_with_reference
from seeds import draw_seed

WIDTH, SITES, TOKENS = 64, 9, 64


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("mode", ["full", "block", "call"])
def test_query_and_norm_gradients_as_accurate_as_eager_in_bf16(mode, heads):
    seed = draw_seed()
    embedding = torch.randn(1, TOKENS, WIDTH, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    options = {"span": 4} if mode == "block" else {}
    result = compare_with_reference(mode, "triton", heads, embedding, SITES, torch.bfloat16, router_options=options,
                                    seed=seed)
    for name in ("grad_query", "grad_norm"):
        for measure in ("", "_scale"):
            err = result[f"{name}{measure}_rel_err"]
            eager = result[f"{name}{measure}_eager_rel_err"]
            assert err <= RATIO * eager + FLOOR_16BIT, f"seed {seed}: {name}{measure} {err:.2e}, eager {eager:.2e}"
    assert result["passed"], f"seed {seed}: {result.get('failed')}"
