"""Host-side helpers shared by the routing ops: device and dtype checks, compute dtypes, tile sizes."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

STORAGE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# Elements of one register tile; fixes tokens per program for a padded head width (see tile_tokens).
TILE_ELEMENTS = 4096


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(*tensors: Tensor) -> None:
    """CUDA tensors, or CPU tensors under the Triton interpreter; anything else is an error."""
    for x in tensors:
        if x.device.type == "cuda":
            continue
        if x.device.type == "cpu" and interpreting():
            continue
        raise RuntimeError(
            f"triton routing needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before import), "
            f"got a tensor on {x.device}"
        )


def check_storage_dtype(dtype: torch.dtype) -> None:
    if dtype not in STORAGE_DTYPES:
        raise TypeError(f"triton routing supports {STORAGE_DTYPES}, got {dtype}")


def check_site_params(embedding_BTD: Tensor, query_SD: Tensor, norm_weight_SD: Tensor, heads: int) -> None:
    """The arguments of a per-pass routing object (FullRouting, BlockRouting)."""
    if embedding_BTD.dim() != 3:
        raise ValueError(f"embedding must be [B, T, D], got {tuple(embedding_BTD.shape)}")
    d = embedding_BTD.shape[2]
    n = query_SD.shape[0]
    if query_SD.shape != (n, d) or norm_weight_SD.shape != (n, d):
        raise ValueError(f"query {tuple(query_SD.shape)} and norm_weight {tuple(norm_weight_SD.shape)} "
                         f"must both be (sites, {d})")
    if d % heads != 0:
        raise ValueError(f"hidden size {d} is not divisible by the number of routing heads {heads}")
    check_storage_dtype(embedding_BTD.dtype)
    check_device(embedding_BTD, query_SD, norm_weight_SD)


def accumulator(dtype: torch.dtype) -> tuple[torch.dtype, tl.dtype]:
    """(torch, triton) compute dtype: fp32 for every storage dtype up to fp32, fp64 for fp64 (gradcheck)."""
    if dtype == torch.float64:
        return torch.float64, tl.float64
    return torch.float32, tl.float32


def split_w(w_SD: Tensor, dtype: torch.dtype) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """w = q g (compute dtype) as the tensor-core operands of the logits and key-path kernels. With bf16 rows:
    w rounded to hi + lo, hi = w in bf16 and lo = the rest in bf16 (16 significant bits, relative error
    <= 2^-17, far below the rows' own rounding), returned as that rounded w and its parts (hi, lo), so that
    kernels that use w in the compute dtype use the same value. Otherwise (w, (w, w)), the same tensor twice:
    no second part. (fp16 rows are not split: a w beyond fp16's range would become inf, and checking for that
    would make the host wait for the GPU.)"""
    if dtype != torch.bfloat16:
        w_SD = w_SD.contiguous()
        return w_SD, (w_SD, w_SD)
    hi = w_SD.to(dtype)
    lo = (w_SD - hi.to(w_SD.dtype)).to(dtype)
    return (hi.to(w_SD.dtype) + lo.to(w_SD.dtype)).contiguous(), (hi.contiguous(), lo.contiguous())


def aligned(x: Tensor) -> bool:
    """Whether Triton sees this tensor's pointer as 16-byte aligned (it specialises on that)."""
    return x.data_ptr() % 16 == 0


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (1 for n < 2)."""
    return 1 << (max(1, n).bit_length() - 1)


def dot_dim(n: int) -> int:
    """A tensor-core product's dimension: a power of two >= 16."""
    return max(16, pow2(n))


def tile_tokens(row_elements: int, tile_elements: int = TILE_ELEMENTS, limit: int = 64) -> int:
    """Tokens per program (a power of two, as tl.arange needs) so that tokens x row width is about
    tile_elements."""
    return pow2_floor(max(1, min(limit, tile_elements // row_elements)))


class SiteFunction(torch.autograd.Function):
    """One site of a per-pass routing object (FullRouting, BlockRouting) as an autograd node:
    apply(routing, site, source_BTD, query_SD, norm_weight_SD). Only site 0 gets the parameters, so their gradients
    (summed over every site by the routing's backward) arrive there once. Each site saves its output through
    autograd, not on `routing`, so it is freed as the backward passes (or kept for a rerun with retain_graph); the
    final site also saves the shared state (rows, statistics, logits)."""

    @staticmethod
    def forward(ctx, routing: Any, site: int, source_BTD: Tensor, query_SD: Optional[Tensor],
                norm_weight_SD: Optional[Tensor]) -> Tensor:
        ctx.routing, ctx.site, ctx.source_dtype = routing, site, source_BTD.dtype
        out_BTD = routing.forward_site(site, source_BTD)
        final = site == routing.n_sites - 1
        ctx.save_for_backward(out_BTD, *(routing.saved_state() if final else ()))
        return out_BTD

    @staticmethod
    @once_differentiable
    def backward(ctx, dout_BTD: Tensor):
        out_BTD, *state = ctx.saved_tensors
        if state:
            ctx.routing.restore(*state)
        dsrc, dq, dg = ctx.routing.backward_site(ctx.site, out_BTD, dout_BTD)
        return None, None, dsrc.to(ctx.source_dtype), dq, dg


def route_site(routing: Any, site: int, source_BTD: Tensor, query_SD: Optional[Tensor],
               norm_weight_SD: Optional[Tensor]) -> Tensor:
    """A routing object's `route`: site 0 must get the full query and key-norm parameters (SiteFunction)."""
    if site == 0 and (query_SD is None or norm_weight_SD is None):
        raise ValueError("site 0 must receive the full query and norm_weight parameters")
    return SiteFunction.apply(routing, site, source_BTD, query_SD, norm_weight_SD)
