"""Qwen3/Llama-style decoder LM whose residual connections are a pluggable strategy (pure PyTorch).

Module names follow the Hugging Face layout (embed_tokens, layers.i.self_attn.q_proj, ..., norm, lm_head)
so that checkpoints map one to one. The depth loop is the same for every residual method:

    state = residual.begin(embed_tokens(ids))
    for site s = 2l (attention) and 2l+1 (MLP) of every layer l (inside DecoderLayer.forward):
        x     = residual.sublayer_input(state, s)          # what the sublayer reads
        y     = sublayer_s(pre_norm_s(x))                  # attention or SwiGLU MLP
        state = residual.sublayer_output(state, s, y)      # what the depth state keeps of it
    logits = lm_head(norm(residual.final(state)))

Incremental decoding (mhar_lit.generation): depth routing mixes sublayer outputs of the SAME token only, so
the only state that crosses tokens is attention's keys and values. A cached forward (`cache=` a
mhar_lit.generation.KVCache) runs this same loop on the new tokens only: the strategy's depth state is
rebuilt for them from their embeddings, attention reads the earlier tokens' keys and values from the cache
and writes its own. Without a cache the forward is the training path, unchanged.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mhar_lit.config import ModelConfig
from mhar_lit.residual.base import ResidualStrategy
from mhar_lit.residual.standard import StandardResidual


class _RMSNormFunction(torch.autograd.Function):
    """The RMSNorm below with a lean backward: it saves the input (storage dtype) and the per-token statistic
    and recomputes the normalised input, where autograd through the plain ops keeps an fp32 copy of the input
    and the normalised tensor (6 bytes per element for bf16 instead of 2, at every norm of the model). The
    input is usually kept anyway (by the residual stream, or by full-mode routing, whose site output is
    the norm's input), so the norm adds only the statistic. Forward ops are the plain ones (bitwise equal);
    the backward is the same chain rule, with the plain path's roundings (the gradient of the normalised
    input rounded to the storage dtype)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (h * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd
        dx = dweight = None
        if ctx.needs_input_grad[1]:
            dweight = (dy * xhat.to(x.dtype)).sum_to_size(weight.shape).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            dxhat = (dy * weight).to(x.dtype).to(rstd.dtype)
            dx = (rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dweight, None


def fused_ops_apply(enabled: bool, x: Tensor) -> bool:
    """Whether a module with fused_ops `enabled` runs liger's Triton kernel on `x` (mhar_lit.kernels.liger_ops).

    Triton kernels need CUDA tensors; CPU tensors qualify too under Triton's interpreter (TRITON_INTERPRET=1),
    which is how the tests run the fused path on the CPU. Anywhere else the plain ops run, bitwise as without
    the switch."""
    return enabled and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


class RMSNorm(nn.Module):
    """g * cast(x * rsqrt(mean x^2 + eps)): statistic in fp32, cast to storage dtype before the weight (HF).

    fused_ops (set through DecoderLM.fused_ops): liger's one-kernel RMSNorm where x and the weight share a dtype.
    Under bf16-mixed a bf16 q/k with an fp32 gain stays plain: the plain product is fp32, liger's is x's dtype."""

    fused_ops = False

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype and fused_ops_apply(self.fused_ops, x):
            from mhar_lit.kernels import liger_ops

            return liger_ops.rms_norm(x, self.weight, self.eps)
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def rope_inverse_frequencies(cfg: ModelConfig) -> Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling or scaling.get("rope_type", "default") == "default":
        return inv_freq
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp in between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed in fp32 and cast to the activation dtype (as HF does).

    The inverse frequencies are a plain fp32 tensor, not a buffer: `module.to(bfloat16)` (Lightning's
    bf16-true) would otherwise round them, which at T = 4096 with Llama-3.1 frequencies shifts angles by
    radians and breaks the identity of a converted model.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inv_freq = rope_inverse_frequencies(cfg).float()

    def forward(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        positions = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def at(self, positions_BT: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin [B, 1, T, head_dim] at per-row positions: the same fp32 products as forward's outer product,
        so a token's angles are bitwise those of the full sequence."""
        if self.inv_freq.device != positions_BT.device:
            self.inv_freq = self.inv_freq.to(positions_BT.device)
        freqs = positions_BT.to(torch.float32).unsqueeze(-1) * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_BHTD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x_BHTD * cos + _rotate_half(x_BHTD) * sin


class Attention(nn.Module):
    """GQA causal self-attention, optional per-head q/k RMSNorm before RoPE, no biases, SDPA kernel.

    fused_ops: liger's RoPE kernel (q and k in one launch) where q, k and cos share a dtype; under bf16-mixed
    a bf16 q against fp32 tables stays plain (the plain product is fp32, liger's would be rounded to bf16)."""

    fused_ops = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x_BTD: Tensor, cos: Tensor, sin: Tensor, kv: Any = None) -> Tensor:
        """kv: None (training: causal attention over this sequence) or a layer's view of a KV cache, which
        stores this call's keys and values and attends over every cached one (`kv.attend(q, k, v)`)."""
        b, t, _ = x_BTD.shape
        q = self.q_proj(x_BTD).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x_BTD).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BTD).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if q.dtype == k.dtype == cos.dtype and fused_ops_apply(self.fused_ops, q):
            from mhar_lit.kernels import liger_ops

            q, k = liger_ops.rope(q, k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
        else:  # the cache stores k, v and attends over every cached column (its mask, GQA without copies)
            out = kv.attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); fused_ops: silu and the product in one liger kernel."""

    fused_ops = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.dtype == up.dtype and fused_ops_apply(self.fused_ops, gate):
            from mhar_lit.kernels import liger_ops

            return self.down_proj(liger_ops.silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """One layer = two routing sites: attention (site 2i) and MLP (site 2i+1), wired by the residual strategy.

    The whole layer runs inside this module's forward so that wrappers which act around a module call
    (FSDP's parameter all-gather, hooks, compile regions) see both sublayers.
    """

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.activation_checkpointing = False
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg)

    def attention_sublayer(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Any = None) -> Tensor:
        return self.self_attn(self.input_layernorm(x), cos, sin, kv)

    def mlp_sublayer(self, x: Tensor) -> Tensor:
        return self.mlp(self.post_attention_layernorm(x))

    def _run(self, fn, *args) -> Tensor:
        # Only the sublayer is recomputed, never the routing: fused routing appends to a shared buffer.
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def forward(self, state: Any, residual: ResidualStrategy, cos: Tensor, sin: Tensor, kv: Any = None) -> Any:
        site = 2 * self.index
        h = residual.sublayer_input(state, site)
        attention_args = (h, cos, sin) if kv is None else (h, cos, sin, kv)
        state = residual.sublayer_output(state, site, self._run(self.attention_sublayer, *attention_args))
        h = residual.sublayer_input(state, site + 1)
        return residual.sublayer_output(state, site + 1, self._run(self.mlp_sublayer, h))


class DecoderLM(nn.Module):
    """Decoder LM; `residual` decides how sublayers are wired across depth (StandardResidual by default).

    init_weights=False leaves the embedding, the linear layers and the strategy's parameters uninitialised, for
    a model built on the meta device whose every tensor is then loaded (mhar_lit.convert): random draws there
    compute nothing, and a normal draw or a division on meta runs torch's Python reference ops, whose first call
    imports torch._dynamo (2.3 s on 2 busy cores)."""

    def __init__(self, config: ModelConfig, residual: Optional[ResidualStrategy] = None,
                 init_weights: bool = True) -> None:
        super().__init__()
        self.config = config
        if init_weights:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:  # without nn.Embedding's own N(0, 1) draw
            self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(config.vocab_size, config.hidden_size),
                                                             freeze=False)
        self.layers = nn.ModuleList(DecoderLayer(config, index) for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # RoPE frequencies are computed, never loaded: on the CPU where the model is built to be loaded (on meta
        # they would be empty), as they are anyway until the first forward moves them to the input's device
        with contextlib.nullcontext() if init_weights else torch.device("cpu"):
            self.rotary = RotaryEmbedding(config)
        if init_weights:
            self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.residual = residual if residual is not None else StandardResidual()
        self.residual.bind(config, init_weights=init_weights)

    def reset_parameters(self) -> None:
        """N(0, init_std) for every Linear and the embedding (no depth scaling), ones for every RMSNorm."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def fused_ops(self) -> bool:
        """liger-kernel's Triton RMSNorm, RoPE and SiLU * up in place of the plain ops (mhar_lit.kernels.liger_ops):
        one kernel each instead of 9, 12 (q and k) and 2 forward, for the launch-bound captured training step and
        decode step (counts in mhar_lit.kernels.liger_ops).
        On CUDA tensors only (and CPU ones under Triton's interpreter, the tests); the plain ops elsewhere. Not
        part of the config or the weights: a run-time choice, as LanguageModel's fused_ops option sets it."""
        return all(module.fused_ops for module in self._fusable_modules())

    @fused_ops.setter
    def fused_ops(self, enabled: bool) -> None:
        if enabled:  # fail at the switch, not at the first forward
            from mhar_lit.kernels import liger_ops  # noqa: F401
        for module in self._fusable_modules():
            module.fused_ops = bool(enabled)

    def _fusable_modules(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, (RMSNorm, Attention, SwiGLU))]

    @property
    def activation_checkpointing(self) -> bool:
        return all(layer.activation_checkpointing for layer in self.layers)

    @activation_checkpointing.setter
    def activation_checkpointing(self, enabled: bool) -> None:
        for layer in self.layers:
            layer.activation_checkpointing = enabled

    def hidden_states(self, input_ids: Tensor, cache: Any = None) -> Tensor:
        """The final-normed hidden state [B, T, D] (what the LM head reads).

        cache: None (the training path) or a mhar_lit.generation.KVCache holding the earlier tokens; then
        input_ids are only the new tokens, placed after them (see the module docstring)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if cache is not None:
            return self._cached_hidden_states(input_ids, cache)
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_position_embeddings {self.config.max_position_embeddings}"
            )
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(seq_len, x.device, x.dtype)
        state = self.residual.begin(x)
        for layer in self.layers:
            state = layer(state, self.residual, cos, sin)
        return self.norm(self.residual.final(state))

    def _cached_hidden_states(self, input_ids: Tensor, cache: Any) -> Tensor:
        """The depth loop on the new tokens only: per-row RoPE positions and the attention mask come from the
        cache (left-padded rows start their positions at their first real token)."""
        x = self.embed_tokens(input_ids)
        positions = cache.begin_step(input_ids.shape[1])
        cos, sin = self.rotary.at(positions, x.dtype)
        state = self.residual.begin(x)
        for layer in self.layers:
            state = layer(state, self.residual, cos, sin, cache.layer(layer.index))
        cache.end_step(input_ids.shape[1])
        return self.norm(self.residual.final(state))

    def forward(self, input_ids: Tensor, cache: Any = None, hidden_only: bool = False) -> Tensor:
        """Logits [B, T, V]; with a cache, of the new tokens only (see hidden_states). hidden_only: the hidden
        states [B, T, D] instead, for a loss that does the LM head product itself (model.fused_loss); through
        forward rather than hidden_states so that compile and module hooks see the call."""
        hidden = self.hidden_states(input_ids, cache)
        return hidden if hidden_only else self.lm_head(hidden)

    def num_parameters(self, non_embedding: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.embed_tokens.weight.numel()
            if not self.config.tie_embeddings:
                total -= self.lm_head.weight.numel()
        return total


def unloaded_decoder(config: ModelConfig, residual: ResidualStrategy,
                     device: str | torch.device = "cpu") -> DecoderLM:
    """A DecoderLM with storage on `device` and no init drawn, for a caller that loads every tensor next: built on
    meta, then each parameter and buffer given empty storage by torch.empty (Module.to_empty goes through
    torch._refs.empty_like for meta tensors, which imports torch's symbolic-shape machinery: ~0.7 s of a
    `generate` start). A tied head becomes a tensor of its own that way, so it is tied again."""
    with torch.device("meta"):
        model = DecoderLM(config, residual, init_weights=False)
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model
