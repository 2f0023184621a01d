"""The training loss of a LanguageModel's decoder, one function for the eager step, the captured unit
(mhar_lit.lit.cuda_graph._LossModule) and the benchmarks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mhar_lit.models.decoder import DecoderLM


def next_token_loss(model: DecoderLM, inputs: Tensor, targets: Tensor, z_loss: float,
                    fused: bool) -> tuple[Tensor, Tensor]:
    """(cross-entropy, mean logsumexp^2) of the model's next-token predictions; z is 0 when z_loss is 0.

    Plain: the logits cast to fp32, then F.cross_entropy. Fused (model.fused_loss): the decoder returns its final
    hidden states and mhar_lit.kernels.linear_cross_entropy does the LM head product chunk by chunk; its ce
    carries the gradient of ce + z_loss * z and its z none, so `ce + z_loss * z` trains the same either way."""
    if fused:
        from mhar_lit.kernels.linear_cross_entropy import fused_linear_cross_entropy

        hidden = model(inputs, hidden_only=True)
        return fused_linear_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, targets.flatten(), z_loss)
    flat = model(inputs).float().flatten(0, 1)
    ce = F.cross_entropy(flat, targets.flatten())
    z = torch.logsumexp(flat, dim=-1).pow(2).mean() if z_loss else flat.new_zeros(())
    return ce, z
