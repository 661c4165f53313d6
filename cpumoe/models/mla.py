"""Multi-head latent attention (MLA, DeepSeek-V2), numerics as transformers' DeepseekV2Attention.

    x -> q_proj                                  (q_lora_rank None)
      |  q_a_proj -> q_a_layernorm -> q_b_proj    (q_lora_rank set)      -> q [.., nh, nope + rope]
    x -> kv_a_proj_with_mqa -> [latent c, k_pe]; kv_b_proj(kv_a_layernorm(c)) -> [k_nope, v] per head
    RoPE on the rope parts only (q_pe per head, k_pe shared by all heads), interleaved pairs (x[2i], x[2i+1])
    k = [k_nope | k_pe], attention with scale (nope + rope)^-0.5, o_proj over nh * v_head_dim.

RoPE: default or scaled (rope.py; the published DeepSeek-V2 checkpoints use yarn), as transformers 5.24's
DeepseekV2: inv_freq and the attention factor over the qk_rope_head_dim channels from the rope init function, cos
and sin multiplied by that factor (so q_pe and k_pe both are; 1 for DeepSeek-V2, whose mscale == mscale_all_dim),
and, for any rope type but default with mscale_all_dim set, the softmax scale multiplied by
yarn_mscale(factor, mscale_all_dim)^2 (transformers' yarn_apply_mscale).

The paged cache holds the expanded per-head K and V (not the compressed latent): the simplest layout the engine's
KVCache ([num_blocks, block_size, nkv, d], one d for K and V) takes. d = max(qk_head_dim, v_head_dim); the shorter
of K, V is zero-padded to d, q likewise (zeros add nothing to q.k), and the output is sliced back to v_head_dim.
This costs nh * 2d per token instead of MLA's kv_lora_rank + rope: caching the latent is a follow-up.
Shapes: T tokens, nh heads, r qk_rope_head_dim, dqk = nope + r, dv v_head_dim, d the cache head_dim.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cpumoe.models.blocks import AttentionContext, RMSNorm, paged_attention
from cpumoe.models.rope import rope_parameters, rope_type, yarn_mscale

# transformers builds q_a_layernorm / kv_a_layernorm with DeepseekV2RMSNorm's default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos, sin [T, r/2] (one angle per channel pair) of positions [T] * inv_freq [r/2], times the attention
    factor (transformers: polar(1, freqs) * attention_scaling)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, r/2]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """qk_head_dim^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 for a scaled RoPE with mscale_all_dim
    (transformers' yarn_apply_mscale, in its order of operations)."""
    scale = qk_head_dim ** -0.5
    if rope_type(rope_scaling) != "default" and rope_scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[2i], x[2i+1]) by angle i, in float32 (transformers' complex multiply); x [..., r],
    cos and sin broadcastable to [..., r/2]."""
    xf = x.float().unflatten(-1, (-1, 2))  # [..., r/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # [..., r/2, 2]
    return out.flatten(-2).to(x.dtype)


class MLAttention(nn.Module):
    """forward(x [B, T, H], positions [T]): whole sequences, no cache; forward(x [T, H], positions, context, layer):
    the engine's flat tokens, K/V into layer `layer` of the paged cache (see the module docstring)."""

    def __init__(self, *, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope_theta: float,
                 cache_head_dim: int, bias: bool = False, rope_scaling: dict | None = None):
        super().__init__()
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={qk_rope_head_dim} must be even")
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if cache_head_dim < max(self.qk_head_dim, v_head_dim):
            raise ValueError(f"cache_head_dim={cache_head_dim} < max(qk_head_dim, v_head_dim)")
        self.cache_head_dim, self.rope_theta, self.rope_scaling = cache_head_dim, rope_theta, rope_scaling
        # plain float32 CPU tensor, not a buffer (built on the meta device; stays fp32)
        self.inv_freq, self.rope_attention_factor = rope_parameters(qk_rope_head_dim, rope_theta, rope_scaling)
        self.scaling = softmax_scale(self.qk_head_dim, rope_scaling)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.qk_head_dim, bias=False)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., T, H], positions [T] -> q, k [..., T, nh, dqk] (RoPE applied), v [..., T, nh, dv]."""
        lead, nh = x.shape[:-1], self.num_heads
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(*lead, nh, self.qk_head_dim).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)  # [.., c], [.., r]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(*lead, nh, self.nope + self.v_head_dim)
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)  # [..., T, nh, nope], [..., T, nh, dv]
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_attention_factor)  # [T, r/2]
        q_pe = apply_rotary_interleaved(q_pe, cos[:, None], sin[:, None])  # [..., T, nh, r]
        k_pe = apply_rotary_interleaved(k_pe, cos, sin)  # [..., T, r]
        q = torch.cat((q_nope, q_pe), dim=-1)  # [..., T, nh, dqk]
        k = torch.cat((k_nope, k_pe.unsqueeze(-2).expand(*lead, nh, self.rope)), dim=-1)  # [..., T, nh, dqk]
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext | None = None,
                layer: int = 0) -> torch.Tensor:
        if context is not None:
            return self._forward_paged(x, positions, context, layer)
        B, T, _ = x.shape  # x [B, T, H], positions [T]
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x, positions))  # [B, nh, T, d*]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)  # [B, nh, T, dv]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.v_head_dim))  # [B, T, H]

    def _forward_paged(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext,
                       layer: int) -> torch.Tensor:  # x [T, H], positions [T]
        T, nh, d = x.shape[0], self.num_heads, self.cache_head_dim
        q, k, v = self._qkv(x, positions)  # [T, nh, dqk] x2, [T, nh, dv]
        k_cache, v_cache = context.kv_caches[layer]  # [num_blocks, block_size, nh, d]
        if k_cache.shape[-2:] != (nh, d):
            raise ValueError(f"layer {layer}'s KV cache is [.., {k_cache.shape[-2]}, {k_cache.shape[-1]}], "
                             f"MLA needs [.., num_heads={nh}, head_dim={d}]")
        k_cache.view(-1, nh, d)[context.slot_mapping] = F.pad(k, (0, d - self.qk_head_dim)).to(k_cache.dtype)
        v_cache.view(-1, nh, d)[context.slot_mapping] = F.pad(v, (0, d - self.v_head_dim)).to(v_cache.dtype)
        q = F.pad(q, (0, d - self.qk_head_dim))  # [T, nh, d]
        if self.scaling != d ** -0.5:  # paged_attention scales by d^-0.5: fold the difference (padding, yarn) into q
            q = q * (self.scaling * math.sqrt(d))
        out = paged_attention(q, k_cache, v_cache, context)[..., :self.v_head_dim]  # [T, nh, dv]
        return self.o_proj(out.reshape(T, nh * self.v_head_dim))  # [T, H]

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
                f"nope={self.nope}, rope={self.rope}, v={self.v_head_dim}, cache_head_dim={self.cache_head_dim}, "
                f"rope_scaling={self.rope_scaling}")
