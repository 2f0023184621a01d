"""The fused routing on a real GPU at the widths users train: full, block and call (delta) mode, H in {1, 2, 4, 8, 16},
fp32 and bf16, at the 100M (d 512, 12 layers), 350M (d 1024, 24 layers), 1B (d 1280, 36 layers) and 8B (d 4096,
32 layers) shapes and a small model's (d 64, 4 layers: heads down to 4 wide); and at the shipped shapes, that a kernel whose gradient of one input is off by 1% fails the check.

Each case is mhar_lit.routing.check at that shape: one forward pass over every site on random routing parameters
and a backward from a random projection of the final site, on the triton router and on the torch router in the
same dtype, with float64 torch as the reference; the fused routing must be as accurate as eager PyTorch (within
2x its error plus a floor: the module docstring of mhar_lit.routing.check says why). No configuration may crash:
full mode with heads wider than full_routing.max_head_width (256 in fp32, 2048 in 16-bit) is refused with a clear
error instead.
CUDA only (skipped on CPU machines; the interpreter covers the kernels' math at small widths in tests/kernels, and
tests/test_routing_backend.py runs the same check through the callback).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from mhar_lit.kernels.full_routing import max_head_width
from mhar_lit.routing.check import compare_with_reference
from mhar_lit.routing.factory import make_router
from routing_defects import DEFECT_INPUTS, OffByOnePercent

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the fused kernels at real widths); "
                       "tests/kernels covers them in the Triton interpreter"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the suite selects Triton's interpreter "
                       "(tests/conftest.py): run this file alone with TRITON_INTERPRET=0 for compiled kernels"),
]

WIDTHS = {"100M": (512, 12), "350M": (1024, 24), "1B": (1280, 36), "8B": (4096, 32), "narrow": (64, 4)}
SHIPPED = ("100M", "350M", "1B")
# one sequence: the kernels tile tokens; the width, heads and depth set the tile shapes. The float64 reference keeps
# every site's stack of sources for its backward (memory ~ sites^2 x tokens x width): at the 8B shape 256 tokens held
# 91 GiB, so that shape runs 64 (still one full token tile of every kernel). "narrow" is a small model's shape
# (routing heads 4 to 64 wide, under the kernels' 16-wide column slices) at 15 tokens, a partial token tile: full
# mode's compiled kernels gave NaN in a prefill of 3 x 5 tokens at width 64 with 8-wide heads, while the
# interpreter matched the reference (docs/LOG.md, 2026-12-07)
TOKENS = {"100M": 256, "350M": 256, "1B": 256, "8B": 64, "narrow": 15}


@pytest.mark.parametrize("shape", list(WIDTHS))
@pytest.mark.parametrize("mode", ["full", "block", "call"])
@pytest.mark.parametrize("heads", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_routing_runs_and_matches_the_reference(shape, mode, heads, dtype):
    """Every (width, mode, heads, dtype) runs forward and backward on the GPU, as accurate as eager PyTorch."""
    width, layers = WIDTHS[shape]
    seed = zlib.crc32(f"{shape}-{mode}-{heads}-{dtype}".encode())
    gen = torch.Generator().manual_seed(seed)
    embedding = torch.randn(1, TOKENS[shape], width, generator=gen, dtype=torch.float64).cuda()
    options = {"span": 4} if mode == "block" else {}  # two layers per block, as the shipped block configs
    if mode == "full" and width // heads > max_head_width(dtype):
        with pytest.raises(ValueError, match="supports routing heads up to"):  # refused, not crashed
            compare_with_reference(mode, "triton", heads, embedding, 2 * layers + 1, dtype, router_options=options)
        return
    result = compare_with_reference(mode, "triton", heads, embedding, 2 * layers + 1, dtype,
                                    router_options=options, seed=seed)
    assert result["passed"], result["failed"]


@pytest.mark.parametrize("shape", SHIPPED)
@pytest.mark.parametrize("mode", ["full", "block"])
@pytest.mark.parametrize("heads", [1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_kernel_off_by_one_percent_fails_the_check(shape, mode, heads, dtype):
    """The Triton router with the gradient of one input 1% too large fails, at every shipped shape and dtype."""
    width, layers = WIDTHS[shape]
    seed = zlib.crc32(f"defect-{shape}-{mode}-{heads}-{dtype}".encode())
    embedding = torch.randn(1, TOKENS[shape], width, generator=torch.Generator().manual_seed(seed),
                            dtype=torch.float64).cuda()
    options = {"span": 4} if mode == "block" else {}
    if mode == "full" and width // heads > max_head_width(dtype):
        with pytest.raises(ValueError, match="supports routing heads up to"):  # refused: no kernel to check
            compare_with_reference(mode, "triton", heads, embedding, 2 * layers + 1, dtype, router_options=options)
        return
    for which in DEFECT_INPUTS:
        router = OffByOnePercent(make_router(mode, "triton", heads, 1e-6, **options), which)
        result = compare_with_reference(mode, "triton", heads, embedding, 2 * layers + 1, dtype,
                                        router_options=options, seed=seed, under_test=router)
        assert not result["passed"], (which, result)
        assert any(f.startswith(f"grad_{which}") for f in result["failed"]), (which, result["failed"])
