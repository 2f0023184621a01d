"""The router check's measure (mhar_lit.routing.check) on the CPU: a correct router passes, and a router whose
gradient of one input is off by 1% fails, in fp32 and bf16, in every mode. The GPU matrix
(tests/test_gpu_routing_matrix.py) does the same with the Triton kernels at the shipped widths."""

import pytest
import torch

from mhar_lit.routing.check import compare_with_reference
from mhar_lit.routing.factory import make_router
from routing_defects import DEFECT_INPUTS, OffByOnePercent

WIDTH, SITES, TOKENS = 64, 9, 32


def _embedding(seed: int = 0) -> torch.Tensor:
    return torch.randn(1, TOKENS, WIDTH, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _options(mode: str) -> dict:
    return {"span": 4} if mode == "block" else {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["full", "block", "call"])
def test_a_correct_router_passes(mode, dtype):
    result = compare_with_reference(mode, "torch", 4, _embedding(), SITES, dtype, router_options=_options(mode))
    assert result["passed"], result.get("failed")


@pytest.mark.parametrize("which", DEFECT_INPUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["full", "block", "call"])
def test_a_gradient_off_by_one_percent_fails(mode, dtype, which):
    router = OffByOnePercent(make_router(mode, "torch", 4, 1e-6, **_options(mode)), which)
    result = compare_with_reference(mode, "torch", 4, _embedding(1), SITES, dtype, router_options=_options(mode),
                                    under_test=router)
    assert not result["passed"]
    assert any(f.startswith(f"grad_{which}") for f in result["failed"]), result["failed"]
