"""The modules of one Gemma 4 decoder layer (gemma4.py has the config, the checkpoint reading and the architecture),
op for op as transformers' Gemma4TextDecoderLayer:

    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    dense  = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h)))
    routed = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h), router(h)))
    out = (h + post_feedforward_layernorm(dense + routed)) * layer_scalar

Every RMSNorm multiplies by its weight in float32, then rounds (GemmaRMSNorm); the value and router norms have no
weight. The attention scale is 1 (q and k are RMS-normed per head instead). Shapes: T tokens, H hidden, nh / nkv
query / key-value heads, d this layer's head_dim, E experts, k top-k.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from cpumoe import ops
from cpumoe.attention import AttentionContext, causal_attention, paged_attention, row_attention
from cpumoe.layer import FusedMoE
from cpumoe.models.blocks import MoEBlock, RMSNorm, RotaryEmbedding, apply_rotary, rms_norm_reference
from cpumoe.routing import select_experts

if TYPE_CHECKING:
    from cpumoe.models.gemma4 import Gemma4Config, RopeSpec


class GemmaRMSNorm(RMSNorm):
    weight_in_float = True  # transformers' Gemma4RMSNorm: weight times the float32 row, then the cast


class UnitRMSNorm(nn.Module):
    """RMSNorm without a weight (transformers' with_scale=False): the row normalized in float32, cast back."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps
        self._ones: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # unit weights for the one-pass op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return rms_norm_reference(x, torch.ones(x.shape[-1]), self.eps, weight_in_float=True)
        key = (x.shape[-1], x.dtype)
        if key not in self._ones:
            self._ones[key] = torch.ones(x.shape[-1], dtype=x.dtype, device="cpu")
        return ops.rms_norm(x.contiguous(), self._ones[key], self.eps, weight_in_float=True)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


class ScaledEmbedding(nn.Embedding):
    """Rows times sqrt(hidden_size), the factor rounded to the table's dtype first (transformers' embed_scale)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(input_ids)
        return rows * torch.tensor(self.embedding_dim ** 0.5).to(rows.dtype)


def rope_inv_freq(head_dim: int, spec: RopeSpec) -> torch.Tensor:
    """inv_freq [head_dim // 2] float32 on the CPU, as transformers computes it. "default": theta^(-2i/d) for every
    channel pair. "proportional": the first int(partial_rotary_factor * d // 2) pairs get theta^(-2i/d) (the
    exponent over the whole head_dim, not the rotated part), the others frequency 0 (cos 1, sin 0: not rotated);
    all divided by `factor`."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if spec.kind == "default":
        channels = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()  # [d/2]
        return 1.0 / (spec.theta ** (channels / head_dim))
    angles = int(spec.partial_rotary_factor * head_dim // 2)
    channels = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float()  # [angles]
    rotated = 1.0 / (spec.theta ** (channels / head_dim))
    inv_freq = torch.cat((rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device="cpu")))
    return inv_freq / spec.factor


def layer_rotary(head_dim: int, spec: RopeSpec) -> RotaryEmbedding:
    """blocks.RotaryEmbedding (rotate-half cos/sin [T, d]) over rope_inv_freq's frequencies."""
    scaling = None if spec.kind == "default" else {
        "rope_type": spec.kind, "partial_rotary_factor": spec.partial_rotary_factor, "factor": spec.factor}
    return RotaryEmbedding(head_dim, spec.theta, scaling, frequencies=(rope_inv_freq(head_dim, spec), 1.0))


class Gemma4Attention(nn.Module):
    """GQA of one layer: q, k RMS-normed per head (with weights) and v (without) before RoPE; attention scale 1;
    a sliding window on "sliding_attention" layers. On full-attention layers with attention_k_eq_v there is no
    v_proj: the values are the keys' projection (before k_norm and RoPE), v-normed. Two ways in, as
    blocks.Attention: forward(x [B, T, H], positions [T]) without a cache, or forward(x [T, H], positions, context,
    layer) over the engine's paged cache.

    The cache holds the same number of channels per token in every layer (config.kv_cache_layout); a layer whose
    K (or V) is smaller, nkv x d < that, views each slot as `cache_heads` heads of d and stores every one of its
    heads cache_heads / nkv times over (Gemma-4-26B-A4B: 2 x 512 global heads in the 8 x 256 slots of the sliding
    layers, each head twice). GQA maps query head h to slot head h // (nh / cache_heads): the same head."""

    def __init__(self, config: Gemma4Config, layer: int):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.kv_heads[layer], c.head_dims[layer]
        nh, nkv, d, bias = self.num_heads, self.num_kv_heads, self.head_dim, c.attention_bias
        sliding = c.layer_types[layer] == "sliding_attention"
        self.q_proj = nn.Linear(c.hidden_size, nh * d, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, nkv * d, bias=bias)
        self.v_proj = None if c.attention_k_eq_v and not sliding else nn.Linear(c.hidden_size, nkv * d, bias=bias)
        self.o_proj = nn.Linear(nh * d, c.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(d, c.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, c.rms_norm_eps)
        self.v_norm = UnitRMSNorm(c.rms_norm_eps)
        self.rotary = layer_rotary(d, c.rope[c.layer_types[layer]])
        self.sliding_window = c.sliding_window if sliding else None
        self.cache_heads = c.kv_cache_channels // d
        self.batch_invariant = False  # paged forward: row_attention instead of paged_attention

    def make_batch_invariant(self) -> None:
        self.batch_invariant = True

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., H] -> q [..., nh, d], k and v [..., nkv, d], normed, before RoPE."""
        lead = x.shape[:-1]
        q = self.q_norm(self.q_proj(x).view(*lead, self.num_heads, self.head_dim))
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = k if self.v_proj is None else self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        return q, self.k_norm(k), self.v_norm(v)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext | None = None,
                layer: int = 0) -> torch.Tensor:
        if context is not None:
            return self._forward_paged(x, positions, context, layer)
        B, T, _ = x.shape  # x [B, T, H], positions [T]
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x))  # [B, heads, T, d]
        cos, sin = self.rotary(positions, x.dtype)  # [T, d]
        q, k, v = apply_rotary(q, cos, sin).contiguous(), apply_rotary(k, cos, sin).contiguous(), v.contiguous()
        out = torch.stack([causal_attention(q[b], k[b], v[b], scale=1.0, sliding_window=self.sliding_window)
                           for b in range(B)])  # [B, nh, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))  # [B, T, H]

    def _forward_paged(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext,
                       layer: int) -> torch.Tensor:  # x [T, H], positions [T]
        T = x.shape[0]
        q, k, v = self._qkv(x)  # [T, nh, d], [T, nkv, d], [T, nkv, d]
        if self.cache_heads != self.num_kv_heads:  # see the class docstring
            repeat = self.cache_heads // self.num_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)  # [T, cache_heads, d]
        cos, sin = self.rotary.for_step(positions, x.dtype, context)  # [T, d]
        k_cache, v_cache = (c.view(*c.shape[:2], self.cache_heads, self.head_dim) for c in context.kv_caches[layer])
        # RoPE on q and k in place, then k and v into their slots: one op
        q, k, v = q.contiguous(), k.contiguous(), v.to(v_cache.dtype).contiguous()
        ops.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, context.slot_mapping)
        attention = row_attention if self.batch_invariant else paged_attention
        out = attention(q, k_cache, v_cache, context, scale=1.0, sliding_window=self.sliding_window)  # [T, nh, d]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))  # [T, H]


class GeluMLP(nn.Module):
    """Dense gated MLP: down(act(gate(x)) * up(x)), act GELU (tanh-approximated for gelu_pytorch_tanh)."""

    def __init__(self, hidden_size: int, inter_size: int, activation: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, inter_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, inter_size, bias=False)
        self.down_proj = nn.Linear(inter_size, hidden_size, bias=False)
        self.approximate = "tanh" if activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H]
        return self.down_proj(F.gelu(self.gate_proj(x), approximate=self.approximate) * self.up_proj(x))


class Gemma4Router(nn.Module):
    """Router of the layer's input h (not of the MLP's normed one): norm(h) * scale * H^-0.5 -> proj -> softmax
    over E -> top-k -> renormalized to sum 1 -> times per_expert_scale of each chosen expert."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)  # [E, H]
        self.scale = nn.Parameter(torch.ones(hidden_size))  # [H]
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))  # [E]
        self.norm = UnitRMSNorm(eps)
        self.top_k, self.root_size = top_k, hidden_size ** -0.5

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [M, H] -> weights float32 [M, k], ids int32 [M, k]."""
        logits = self.proj(self.norm(h) * self.scale * self.root_size)  # [M, E], the activations' dtype
        weights, ids = select_experts(logits, self.top_k, scoring="softmax", renormalize=True)
        return weights * self.per_expert_scale.float()[ids], ids

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}"


class Gemma4DecoderLayer(MoEBlock):
    """One layer (see the module docstring). It is the MoEBlock itself: transformers keeps `router` and `experts`
    beside `mlp` in the layer, so the experts' tensors are layers.{l}.experts.gate_up_proj [E, 2I, H] (gate rows,
    then up rows) and layers.{l}.experts.down_proj [E, H, I], FusedMoE's w13 and w2 as they are."""

    def __init__(self, config: Gemma4Config, index: int, backend: str):
        c, H = config, config.hidden_size
        super().__init__(hidden_size=H, num_experts=c.num_experts, inter_size=c.moe_intermediate_size,
                         top_k=c.top_k_experts, renormalize=True, backend=backend)
        del self.gate  # the router is `router` here
        self.layer_idx, self.activation = index, c.activation
        self.self_attn = Gemma4Attention(c, index)
        self.mlp = GeluMLP(H, c.intermediate_size, c.activation)
        self.input_layernorm = GemmaRMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(H, c.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(H, c.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(H, c.rms_norm_eps)
        self.post_feedforward_layernorm_1 = GemmaRMSNorm(H, c.rms_norm_eps)
        self.pre_feedforward_layernorm_2 = GemmaRMSNorm(H, c.rms_norm_eps)
        self.post_feedforward_layernorm_2 = GemmaRMSNorm(H, c.rms_norm_eps)
        self.router = Gemma4Router(H, c.num_experts, c.top_k_experts, c.rms_norm_eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))  # a buffer in transformers, saved with the weights

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor, expert_reader=None, dtype=None) -> None:
        """As MoEBlock's, with the layer's GELU; routing is the router's (FusedMoE.experts takes its result)."""
        self.experts = FusedMoE(w13, w2, top_k=self.top_k, activation=self.activation, renormalize=True,
                                backend=self.backend, expert_reader=expert_reader, dtype=dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                context: AttentionContext | None = None) -> torch.Tensor:  # x [B, T, H] or, with context, [T, H]
        if self.experts is None:
            raise RuntimeError("Gemma4DecoderLayer has no experts yet: load the model with cpumoe.models.load_model")
        attn = self.self_attn(self.input_layernorm(x), positions, context, self.layer_idx)
        x = x + self.post_attention_layernorm(attn)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        flat = x.reshape(-1, x.shape[-1])  # [M, H]
        weights, ids = self.router(flat)  # [M, k] float32, int32
        routed = self.experts.experts(self.pre_feedforward_layernorm_2(flat), weights, ids)  # [M, H]
        routed = self.post_feedforward_layernorm_2(routed).view(x.shape)
        x = x + self.post_feedforward_layernorm(dense + routed)
        return x * self.layer_scalar

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, top_k={self.top_k}, activation={self.activation}"
