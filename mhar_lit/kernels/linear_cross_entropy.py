"""Fused LM head + cross-entropy (+ z-loss) without the [tokens, vocabulary] logits: liger-kernel's Triton
cross-entropy kernel driven chunk by chunk over the tokens (model.fused_loss: true).

    for each chunk of C tokens (x_CD = hidden states, W_VD = LM head):
        logits_CV = x_CD @ W_VD^T                      # compute dtype (bf16 under bf16-true or bf16-mixed)
        liger_cross_entropy_kernel(logits_CV, y_C)     # per row: loss, lse^2, and d(loss)/d(logits) IN PLACE
        dx_CD  = dlogits_CV @ W_VD                     # gradients are computed in the forward
        dW_VD += dlogits_CV^T @ x_CD                   # fp32 accumulator
    backward: dx, dW times the incoming gradient (a scalar)

Peak extra memory is one chunk of logits (C x V in the compute dtype) and dW instead of the fp32 logits of every
token and their gradient (at 1B, 8 x 2048 tokens x 151,936: ~10 GB each). The reference is the plain loss in
LanguageModel._loss (`F.cross_entropy` of the fp32-cast logits, z-loss = mean logsumexp^2); tests/
test_fused_loss.py checks this against it and against liger's own LigerFusedLinearCrossEntropyLoss.

Why not LigerFusedLinearCrossEntropyLoss itself: in liger-kernel 0.8.5 its forward reads the token count with
`.item()` and its backward compares the incoming gradient with 1.0 by `torch.equal`; both wait for the GPU, which
CUDA-graph capture refuses (the captured step is the default). Every target here is a real token (no
ignore_index), so the count is the static number of rows, and the backward always multiplies. The per-row kernel,
the numerically delicate part, is liger's. cut-cross-entropy was the other candidate: it has no z-loss and
builds its index of valid targets with `nonzero()`, another host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Tokens per chunk. The dW accumulation reads and writes the fp32 V x D accumulator once per chunk; at 4096
# tokens that GEMM does ~1000 FLOPs per accumulator byte, above an H100's ~300 FLOP/byte balance point, while
# one bf16 chunk of logits at V = 151,936 is 1.2 GB.
CHUNK_TOKENS = 4096
# liger's own block over the vocabulary for this kernel (65536 // 2): larger blocks spill registers.
MAX_BLOCK = 32768


def _liger_kernel():
    try:
        from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel
    except ImportError as err:
        raise ImportError("model.fused_loss needs liger-kernel: pip install liger-kernel==0.8.5 "
                          f"(a dependency of mhar_lit) ({err})") from err
    return liger_cross_entropy_kernel


def _accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b with acc in fp32 and a, b possibly bf16, without a V x D temporary where torch allows: fp32
    operands accumulate in place; bf16 ones on CUDA in one GEMM with an fp32 output (addmm's out_dtype, CUDA
    only); elsewhere their product is rounded to bf16, then added in fp32."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)


def _chunk_loss_and_grad(logits_CV: Tensor, targets_C: Tensor, out_loss: Tensor, out_z: Tensor, rows: int,
                         z_weight: float, gradients: bool) -> None:
    """Liger's kernel on one chunk: out_loss[i] = (lse_i - logit_i,y) / rows + z_weight lse_i^2 / rows,
    out_z[i] = z_weight lse_i^2 / rows, and (gradients) logits_CV overwritten with d(sum of out_loss)/d(logits)."""
    vocab = logits_CV.shape[1]
    _liger_kernel()[(logits_CV.shape[0],)](
        X_ptr=logits_CV, X_stride=logits_CV.stride(-2), Y_ptr=targets_C, Y_stride=targets_C.stride(-1),
        weight_ptr=None, loss_ptr=out_loss, z_loss_ptr=out_z, loss_stride=out_loss.stride(-1),
        token_accuracy_ptr=None, token_accuracy_stride=0, predicted_tokens_ptr=None, predicted_tokens_stride=0,
        n_cols=vocab, n_non_ignore=rows, sum_non_ignore_weight=rows, weight_sum=0.0, ignore_index=-100,
        lse_square_scale=z_weight, label_smoothing=0.0, reduction="mean", softcap=None,
        RETURN_Z_LOSS=z_weight > 0, RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False,
        HAS_WEIGHT=False, HAS_SOFTCAPPING=False, HAS_GRADIENTS=gradients,
        BLOCK_SIZE=min(MAX_BLOCK, 1 << (vocab - 1).bit_length()), num_warps=32,
    )


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """(x_ND, W_VD, y_N) -> (ce + z_weight * z, z): the loss whose gradient flows, and z for logging only."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, weight_VD: Tensor, targets_N: Tensor, z_weight: float, compute_dtype: torch.dtype,
                chunk: int, gradients: bool):
        rows = x_ND.shape[0]
        with torch.autocast(x_ND.device.type, enabled=False):  # the casts below are the whole precision policy
            x, w = x_ND.to(compute_dtype), weight_VD.to(compute_dtype)
            grad_x = torch.empty_like(x) if gradients else None
            grad_w = torch.zeros(weight_VD.shape, dtype=torch.float32, device=w.device) if gradients else None
            loss_N = torch.zeros(rows, dtype=torch.float32, device=x.device)
            z_N = torch.zeros(rows, dtype=torch.float32, device=x.device)
            for start in range(0, rows, chunk):
                end = min(start + chunk, rows)
                logits = x[start:end] @ w.t()
                _chunk_loss_and_grad(logits, targets_N[start:end], loss_N[start:end], z_N[start:end], rows, z_weight,
                                     gradients)
                if gradients:
                    torch.mm(logits, w, out=grad_x[start:end])
                    _accumulate_mm(grad_w, logits.t(), x[start:end])
        ctx.save_for_backward(grad_x, grad_w)
        ctx.dtypes = (x_ND.dtype, weight_VD.dtype)
        z = z_N.sum() / z_weight if z_weight > 0 else z_N.sum()
        ctx.mark_non_differentiable(z)
        return loss_N.sum(), z

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_z: Tensor):
        grad_x, grad_w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        # Always a new tensor: under capture, the forward graph rewrites grad_w at every replay, so the backward
        # must not hand out that buffer itself as the weight's gradient.
        dx = torch.mul(grad_x, grad_loss, out=torch.empty(grad_x.shape, dtype=x_dtype, device=grad_x.device))
        dw = torch.mul(grad_w, grad_loss, out=torch.empty(grad_w.shape, dtype=w_dtype, device=grad_w.device))
        return dx, dw, None, None, None, None, None


def fused_linear_cross_entropy(hidden_ND: Tensor, weight_VD: Tensor, targets_N: Tensor, z_weight: float = 0.0,
                               chunk: int = CHUNK_TOKENS) -> tuple[Tensor, Tensor]:
    """(ce, z) of `hidden_ND @ weight_VD^T` against `targets_N` without materialising the logits.

    ce carries the gradient of ce + z_weight * z; z (mean logsumexp^2, 0 when z_weight is 0) has none, so a caller
    that adds z_weight * z gets the right value and the right gradient. The matmuls run in the autocast dtype
    when autocast is on (bf16-mixed), else in the weight's dtype; the loss and dW accumulate in fp32."""
    if hidden_ND.dim() != 2 or targets_N.shape != hidden_ND.shape[:1]:
        raise ValueError(f"expected hidden [N, D] and targets [N], got {tuple(hidden_ND.shape)} and "
                         f"{tuple(targets_N.shape)}")
    device = hidden_ND.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight_VD.dtype
    gradients = torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad)
    total, z = _FusedLinearCrossEntropy.apply(hidden_ND, weight_VD, targets_N.contiguous(), float(z_weight),
                                              compute_dtype, chunk, gradients)
    return total - z_weight * z, z
