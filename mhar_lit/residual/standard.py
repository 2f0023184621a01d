"""Standard pre-norm residual stream (the baseline), expressed as a residual strategy.

    h_0 = embedding
    x_s = h_s                      (the sublayer's pre-norm is applied by the model)
    h_{s+1} = h_s + y_s
    final: h_{2L}
"""

from __future__ import annotations

from torch import Tensor

from mhar_lit.residual.base import ResidualStrategy


class StandardResidual(ResidualStrategy):
    """x <- x + sublayer(norm(x)): the additive residual of a pre-norm Transformer (Qwen3, Llama)."""

    is_standard_residual = True
    preserves_pretrained_function = True

    def begin(self, embedding: Tensor) -> Tensor:
        return embedding

    def sublayer_input(self, state: Tensor, site: int) -> Tensor:
        return state

    def sublayer_output(self, state: Tensor, site: int, output: Tensor) -> Tensor:
        return state + output

    def final(self, state: Tensor) -> Tensor:
        return state
