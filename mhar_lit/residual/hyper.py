"""Hyper-connections (Zhu et al., arXiv 2409.19606), n residual streams (docs/method.md F).

variant="zhu" (default, docs/method.md F.1), static (SHC) or dynamic (DHC):

    H^0 = n copies of the embedding                                 H: [B, T, n, d]
    sublayer k:  u   = sum_i A_m[i] H_i                             width connection, reads the input
                 y   = sublayer_k(norm(u))
                 H'_j = sum_i A_r[i, j] H_i + B[j] y                 depth connection, writes the output
    final: h = sum_i H_i

    static init: A_m = e_{k mod n}, A_r = I, B = 1   -> streams stay equal to the standard residual h;
                 the final sum is n*h and the final RMSNorm removes the scale (up to its epsilon).
    dynamic:     Hn = RMSNorm(H) per stream, A_m += s_a tanh(Hn W_m), A_r += s_a tanh(Hn W_r),
                 B += s_b tanh(Hn W_b)^T; W_* = 0, s_a = s_b = 0.01 at init, so it starts static.

variant="mhar_code" (docs/method.md F.2) reproduces the MHAR authors' HC baseline: u = sum_r softmax(alpha)_r H_r,
H'_j = sum_i A[j, i] H_i + beta_j y, collapse by the mean; alpha ~ N(0, 0.02), A = I + 0.02 noise,
beta = e_0 + 0.02 noise; static only. It is not equivalent to a standard residual at init.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mhar_lit.config import ModelConfig
from mhar_lit.residual.base import ResidualStrategy

VARIANTS = ("zhu", "mhar_code")
DYNAMIC_SCALE_INIT = 0.01  # s_a = s_b at init (Zhu et al.)


def _rms_normalise(x: Tensor, eps: float) -> Tensor:
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class HyperConnections(ResidualStrategy):
    """n-stream hyper-connections; `dynamic` adds the per-token DHC terms (Zhu et al. F.1)."""

    label_options = ("streams", "dynamic", "variant")

    def __init__(self, streams: int = 4, dynamic: bool = True, variant: str = "zhu", eps: float = 1e-6) -> None:
        super().__init__()
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        if variant not in VARIANTS:
            raise ValueError(f"unknown hyper-connection variant {variant!r}; expected one of {VARIANTS}")
        if variant == "mhar_code" and dynamic:
            raise ValueError("variant 'mhar_code' is static only; set dynamic: false")
        self.streams, self.dynamic, self.variant = streams, dynamic, variant
        self.eps = eps

    def build(self, config: ModelConfig) -> None:
        sites, n, d = config.num_sites, self.streams, config.hidden_size
        self.read = nn.Parameter(torch.empty(sites, n))  # A_m (or alpha logits for mhar_code)
        self.mix = nn.Parameter(torch.empty(sites, n, n))  # A_r[i, j] (mhar_code: A[j, i])
        self.write = nn.Parameter(torch.empty(sites, n))  # B (or beta)
        if self.dynamic:
            self.stream_norm = nn.Parameter(torch.empty(sites, d))
            self.read_proj = nn.Parameter(torch.empty(sites, d, 1))
            self.mix_proj = nn.Parameter(torch.empty(sites, d, n))
            self.write_proj = nn.Parameter(torch.empty(sites, d, 1))
            self.scale_alpha = nn.Parameter(torch.empty(sites, 1))
            self.scale_beta = nn.Parameter(torch.empty(sites, 1))

    def reset_parameters(self) -> None:
        n = self.streams
        with torch.no_grad():
            eye = torch.eye(n)
            if self.variant == "zhu":
                self.read.zero_()
                for k in range(self.read.shape[0]):
                    self.read[k, k % n] = 1.0
                self.mix.copy_(eye.expand_as(self.mix))
                self.write.fill_(1.0)
            else:
                std = self.model_config.init_std
                self.read.normal_(std=std)
                self.mix.copy_(eye + std * torch.randn_like(self.mix))
                self.write.copy_(eye[0] + std * torch.randn_like(self.write))
            if self.dynamic:
                self.stream_norm.fill_(1.0)
                for p in (self.read_proj, self.mix_proj, self.write_proj):
                    p.zero_()
                self.scale_alpha.fill_(DYNAMIC_SCALE_INIT)
                self.scale_beta.fill_(DYNAMIC_SCALE_INIT)

    def no_decay_parameter_names(self) -> set[str]:
        # The static connections start at the identity-equivalent (one-hot, I, ones); decaying them toward 0
        # would pull away from that, like decaying a gate. Only the exclusion option uses this set.
        names = {"read", "mix", "write"}
        return names | ({"stream_norm", "scale_alpha", "scale_beta"} if self.dynamic else set())

    def _connections(self, streams_BTnD: Tensor, site: int) -> tuple[Tensor, Tensor, Tensor]:
        """Per-site (read [.., n], mix [.., n, n], write [.., n]) weights, per token when dynamic."""
        dtype = streams_BTnD.dtype
        read, mix, write = (p[site].to(dtype) for p in (self.read, self.mix, self.write))
        if self.variant == "mhar_code":
            # softmax in at least fp32 (fp64 stays fp64, as everywhere else in the package)
            return read.to(torch.promote_types(dtype, torch.float32)).softmax(-1).to(dtype), mix.transpose(0, 1), write
        if self.dynamic:
            normed = _rms_normalise(streams_BTnD, self.eps) * self.stream_norm[site].to(dtype)
            s_a, s_b = self.scale_alpha[site].to(dtype), self.scale_beta[site].to(dtype)
            read = read + s_a * torch.tanh(normed @ self.read_proj[site].to(dtype)).squeeze(-1)
            mix = mix + s_a * torch.tanh(normed @ self.mix_proj[site].to(dtype))
            write = write + s_b * torch.tanh(normed @ self.write_proj[site].to(dtype)).squeeze(-1)
        return read, mix, write

    def begin(self, embedding: Tensor) -> dict:
        streams = embedding.unsqueeze(-2).expand(*embedding.shape[:-1], self.streams, embedding.shape[-1])
        return {"streams": streams, "mix": None, "write": None}

    def sublayer_input(self, state: dict, site: int) -> Tensor:
        streams = state["streams"]
        read, state["mix"], state["write"] = self._connections(streams, site)
        return (read.unsqueeze(-1) * streams).sum(-2)

    def sublayer_output(self, state: dict, site: int, output: Tensor) -> dict:
        mix, write, streams = state["mix"], state["write"], state["streams"]
        # H'_j = sum_i mix[i, j] H_i + write[j] y ; mix is [n, n] (static) or [B, T, n, n] (dynamic).
        mixed = torch.einsum("...ij,...id->...jd", mix, streams)
        state["streams"] = mixed + write.unsqueeze(-1) * output.unsqueeze(-2)
        return state

    def final(self, state: dict) -> Tensor:
        streams = state["streams"]
        return streams.mean(-2) if self.variant == "mhar_code" else streams.sum(-2)
