"""liger-kernel's Triton RMSNorm, SwiGLU and RoPE: the decoder's elementwise work in one kernel per op
(DecoderLM.fused_ops; mhar_lit.models.decoder chooses when they run). Operators per call, forward / backward,
counted on the CPU with a dispatch mode for bf16 tensors (each is a kernel launch on CUDA, or two for a slice's
backward):

    RMSNorm           plain 9 / 13   liger 1 / 4 (backward: a zero fill of dX, the kernel, the sum of the
                                                  per-program dW partials and its cast to the weight's dtype;
                                                  3 for an fp32 weight)
    RoPE of q and k   plain 12 / 20  liger 1 / 1 (both rotated in place in one launch)
    SiLU * up         plain 2 / 3    liger 1 / 1

None of them reads a value back to the host (no .item(), .tolist(), nonzero), so they run inside CUDA-graph
capture; their Python side only launches kernels and allocates. Imported on the first fused call: it imports
Triton and liger-kernel, which the plain path never needs.
"""

from __future__ import annotations

from torch import Tensor

try:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
except ImportError as err:
    raise ImportError("model.fused_ops needs liger-kernel: pip install liger-kernel==0.8.5 "
                      f"(a dependency of mhar_lit) ({err})") from err


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * cast(x * rsqrt(mean x^2 + eps)) for x and weight of one dtype.

    Casting mode "llama" is our RMSNorm's rounding: the statistic in fp32, the normalised row cast to x's dtype
    before the weight multiplies it; offset 0 (a Gemma-style `1 + weight` is not ours). in_place=False: liger's
    default writes dX into dY's storage, which corrupts a gradient autograd hands to another consumer as well
    (an addition's backward passes one tensor to both operands); the price is the zero fill of a new dX."""
    return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)


def rope(q_BHTD: Tensor, k_BHTD: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(q, k) rotated as apply_rope does. cos, sin: [T, head_dim] or [B, 1, T, head_dim] (RotaryEmbedding's
    forward and `at`), both halves equal (liger reads the first).

    liger's kernel reads q and k as [B, T, H, D] in memory: our [B, H, T, D] are transposed views of that
    storage, so no copy is made. It OVERWRITES q's and k's storage (its outputs are views of its inputs):
    the projections' or q/k norms' outputs, which nothing else reads after this. Its backward rotates dq and dk
    in place too, after the same transpose: a copy (one kernel each) where the attention backward's gradients
    are not laid out [B, T, H, D] in memory."""
    return LigerRopeFunction.apply(q_BHTD, k_BHTD, cos, sin)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up with silu in fp32 rounded to up's dtype before the product, as F.silu's output is.

    Its backward writes the two input gradients into the saved gate and up tensors: one backward per forward
    (a second backward through the same graph, retain_graph=True, would read gradients as activations)."""
    return LigerSiLUMulFunction.apply(gate, up)
