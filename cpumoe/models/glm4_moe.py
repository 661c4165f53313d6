"""GLM-4.5 / 4.6 / 4.7 (model_type "glm4_moe": zai-org/GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7), as transformers'
Glm4MoeForCausalLM.

    input_ids -> embed -> N x [x += attn(norm(x)); x += mlp(norm(x))] -> norm -> lm_head -> logits

Where it departs from the Llama-style decoder (its layers are the shared DecoderLayer over these modules):
- partial rotary: RoPE (rotate-half) on the first rotary_dim = int(head_dim * partial_rotary_factor) channels of
  each query and key head only (GLM: 64 of 128), the others pass through; the factor is read as transformers
  reads it: the rope dict's, else config.json's top-level one, else 0.5;
- head_dim from the config (128, with hidden 4096 and 96 heads: the heads are wider than hidden / heads);
  q/k/v biased when attention_bias (o_proj never); q/k RMSNorm per head before RoPE when use_qk_norm;
- layers l < first_k_dense_replace have a dense GatedMLP of intermediate_size, the others DeepSeek-V3's MoE
  (deepseek_v3.DeepseekV3MoE, reused as it is): float32 router mlp.gate (weight and e_score_correction_bias stay
  float32, as transformers' _keep_in_fp32_modules_strict keeps them), sigmoid scores, + correction bias for the
  choice only, the topk_group best of n_group groups (a group scored by its best two), top-k, renormalized when
  norm_topk_prob, * routed_scaling_factor; plus an ungated shared MLP mlp.shared_experts of
  moe_intermediate_size * n_shared_experts. With one group (the published models) nothing is masked, so the
  router runs as cpumoe's single routing op rather than the grouped torch path.
The multi-token-prediction layer (model.layers.{num_hidden_layers}, num_nextn_predict_layers) is not read, as
transformers does not. GLM-4.7-Flash is another model_type (glm4_moe_lite: multi-head latent attention), not this
file. Refused with a CheckpointError: hidden_act other than silu, RoPE types rope.py does not support, an odd or
empty rotary_dim, and expert groups the router cannot form.
Config: https://huggingface.co/docs/transformers/model_doc/glm4_moe
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cpumoe import torch_gemm
from cpumoe.attention import AttentionContext, paged_attention, row_attention
from cpumoe.loader import CheckpointConfig, CheckpointError
from cpumoe.models.architecture import Architecture, DecoderLayer, ModelPreset
from cpumoe.models.blocks import Attention, GatedMLP, QKNorm, RMSNorm, RotaryEmbedding, apply_rotary
from cpumoe.models.deepseek_v3 import DeepseekV3MoE
from cpumoe.models.rope import rope_from_config

# transformers' Glm4MoeConfig defaults, where config.json leaves a field out
DEFAULTS = dict(num_key_value_heads=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                norm_topk_prob=True, routed_scaling_factor=1.0, use_qk_norm=False, attention_bias=False,
                rms_norm_eps=1e-5, partial_rotary_factor=0.5, tie_word_embeddings=False)


@dataclass(slots=True)
class Glm4MoeConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # the leading channels of each head that RoPE rotates
    intermediate_size: int  # dense layers
    moe_intermediate_size: int  # each routed expert, and each shared one
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    use_qk_norm: bool
    attention_bias: bool
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # rope.rope_from_config's normalized dict; None: default RoPE
    tie_word_embeddings: bool

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def moe_block(self, backend: str) -> DeepseekV3MoE:
        grouped = self.n_group > 1  # one group masks nothing: the C++ routing op takes it
        return DeepseekV3MoE(
            hidden_size=self.hidden_size, num_experts=self.n_routed_experts, inter_size=self.moe_intermediate_size,
            top_k=self.num_experts_per_tok, shared_inter_size=self.moe_intermediate_size * self.n_shared_experts,
            num_expert_group=self.n_group if grouped else None, topk_group=self.topk_group if grouped else None,
            renormalize=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor, backend=backend)

    @classmethod
    def from_checkpoint(cls, ckpt: CheckpointConfig) -> "Glm4MoeConfig":
        get = ckpt.config_get

        def field(name: str):
            return get(name, default=DEFAULTS[name])

        where = ckpt.path
        if (act := get("hidden_act", default="silu")) != "silu":
            raise CheckpointError(f"{where}: hidden_act {act!r} is not supported (silu only)")
        try:
            rope_theta, rope_scaling = rope_from_config(ckpt.config)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
        heads, hidden = get("num_attention_heads"), get("hidden_size")
        head_dim = get("head_dim", default=None) or hidden // heads
        rope = ckpt.config.get("rope_scaling") or ckpt.config.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", field("partial_rotary_factor"))
        rotary_dim = int(head_dim * factor) if isinstance(factor, (int, float)) else 0
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise CheckpointError(f"{where}: partial_rotary_factor {factor} gives {rotary_dim} rotary channels of "
                                  f"head_dim {head_dim}; RoPE needs an even number in 2..{head_dim}")
        config = cls(
            vocab_size=get("vocab_size"), hidden_size=hidden, num_hidden_layers=get("num_hidden_layers"),
            num_attention_heads=heads, num_key_value_heads=field("num_key_value_heads"), head_dim=head_dim,
            rotary_dim=rotary_dim, intermediate_size=get("intermediate_size"),
            moe_intermediate_size=get("moe_intermediate_size"), n_routed_experts=get("n_routed_experts"),
            num_experts_per_tok=get("num_experts_per_tok"), n_shared_experts=field("n_shared_experts") or 0,
            first_k_dense_replace=field("first_k_dense_replace") or 0, n_group=field("n_group") or 1,
            topk_group=field("topk_group") or 1, norm_topk_prob=bool(field("norm_topk_prob")),
            routed_scaling_factor=float(field("routed_scaling_factor")), use_qk_norm=bool(field("use_qk_norm")),
            attention_bias=bool(field("attention_bias")), rms_norm_eps=field("rms_norm_eps"),
            rope_theta=rope_theta, rope_scaling=rope_scaling, tie_word_embeddings=bool(field("tie_word_embeddings")))
        config._check_groups(where)
        return config

    def _check_groups(self, where) -> None:
        """What transformers' router needs of the experts (it would fail, or pick from an empty group, otherwise)."""
        E, G = self.n_routed_experts, self.n_group
        if self.first_k_dense_replace >= self.num_hidden_layers:
            return  # no MoE layer routes
        if E < 2 or E % G or E // G < 2:
            raise CheckpointError(f"{where}: n_routed_experts {E} must split into n_group {G} groups of at least 2 "
                                  "experts (a group is scored by its best two)")
        if not 1 <= self.topk_group <= G:
            raise CheckpointError(f"{where}: topk_group {self.topk_group} must be in 1..n_group {G}")
        if not 1 <= self.num_experts_per_tok <= self.topk_group * (E // G):
            raise CheckpointError(f"{where}: num_experts_per_tok {self.num_experts_per_tok} must be in 1.."
                                  f"{self.topk_group * (E // G)}, the experts of the topk_group kept groups")


class PartialRotaryAttention(Attention):
    """blocks.Attention (GQA, per-head q/k norm, q/k/v biases) with RoPE on each head's first rotary_dim channels
    only, rotate-half within them, the rest passed through (transformers' Glm4Moe apply_rotary_pos_emb). The
    rotated keys go to the paged cache whole; the fused rope-and-cache op rotates whole heads, so here RoPE runs in
    torch (the same elementwise ops, so the same rounding, as transformers) and the cache is written by index."""

    def __init__(self, *, rotary_dim: int, rope_theta: float, rope_scaling: dict | None, **kwargs):
        super().__init__(rope_theta=rope_theta, rope_scaling=rope_scaling, **kwargs)
        self.rotary_dim = rotary_dim
        self.rotary = RotaryEmbedding(rotary_dim, rope_theta, rope_scaling)  # cos, sin [T, rotary_dim]

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [..., d]
        r = self.rotary_dim
        return torch.cat((apply_rotary(x[..., :r], cos, sin), x[..., r:]), dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext | None = None,
                layer: int = 0) -> torch.Tensor:
        if context is not None:
            return self._forward_paged(x, positions, context, layer)
        B, T, _ = x.shape  # x [B, T, H], positions [T]
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x))  # [B, heads, T, d]
        cos, sin = self.rotary(positions, x.dtype)  # [T, r]
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        out = torch_gemm.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, nh, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))  # [B, T, H]

    def _forward_paged(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext,
                       layer: int) -> torch.Tensor:  # x [T, H], positions [T]
        T = x.shape[0]
        q, k, v = self._qkv(x)  # [T, nh, d], [T, nkv, d], [T, nkv, d]
        cos, sin = (t[:, None] for t in self.rotary.for_step(positions, x.dtype, context))  # [T, 1, r]: over heads
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        k_cache, v_cache = context.kv_caches[layer]  # [num_blocks, block_size, nkv, d]
        nkv, d = self.num_kv_heads, self.head_dim
        k_cache.view(-1, nkv, d).index_copy_(0, context.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, nkv, d).index_copy_(0, context.slot_mapping, v.to(v_cache.dtype))
        attention = row_attention if self.batch_invariant else paged_attention
        out = attention(q.contiguous(), k_cache, v_cache, context)  # [T, nh, d]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))  # [T, H]

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}"


class Glm4MoeArchitecture(Architecture):
    model_type = "glm4_moe"
    hf_name = "Glm4Moe"
    fp32_parameters = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    presets = (
        ModelPreset("glm-4.5-air", "zai-org/GLM-4.5-Air", dict(
            num_hidden_layers=46, hidden_size=4096, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
            vocab_size=151552, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128,
            n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=1.0, use_qk_norm=False, attention_bias=True,
            partial_rotary_factor=0.5, rope_theta=1000000, rope_scaling=None, hidden_act="silu",
            rms_norm_eps=1e-5, max_position_embeddings=131072, num_nextn_predict_layers=1,
            tie_word_embeddings=False)),
        ModelPreset("glm-4.5", "zai-org/GLM-4.5", dict(
            num_hidden_layers=92, hidden_size=5120, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
            vocab_size=151552, intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160,
            n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, n_group=1, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
            partial_rotary_factor=0.5, rope_theta=1000000, rope_scaling=None, hidden_act="silu",
            rms_norm_eps=1e-5, max_position_embeddings=131072, num_nextn_predict_layers=1,
            tie_word_embeddings=False)),
    )
    # one dense layer, then two MoE ones; heads wider than hidden / heads (32 > 64 / 4), GQA, half of each head
    # rotated (the published factor), q/k norm and biases; 8 experts in 4 groups of which 2 stay, top-2, scaled
    tiny = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                use_qk_norm=True, attention_bias=True, max_position_embeddings=512,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))

    def config(self, ckpt: CheckpointConfig) -> Glm4MoeConfig:
        return Glm4MoeConfig.from_checkpoint(ckpt)

    def layer(self, config: Glm4MoeConfig, index: int, backend: str) -> nn.Module:
        c = config
        attention = PartialRotaryAttention(
            hidden_size=c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim, rotary_dim=c.rotary_dim, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
            qk_norm=QKNorm.HEAD if c.use_qk_norm else QKNorm.NONE, norm_eps=c.rms_norm_eps,
            qkv_bias=c.attention_bias, o_bias=False)
        mlp = c.moe_block(backend) if c.is_moe_layer(index) else GatedMLP(c.hidden_size, c.intermediate_size)
        return DecoderLayer(index, self_attn=attention, mlp=mlp,
                            input_layernorm=RMSNorm(c.hidden_size, c.rms_norm_eps),
                            post_attention_layernorm=RMSNorm(c.hidden_size, c.rms_norm_eps))

    def layer_shape_config(self, *, hidden: int, inter: int, experts: int, top_k: int) -> dict:
        # one group: any expert count routes
        return dict(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                    num_experts_per_tok=top_k, n_group=1, topk_group=1)

    def layer_preset(self, preset: ModelPreset):
        from cpumoe.presets import LayerPreset
        c = self.preset_config(preset)
        return LayerPreset(preset.name, hidden=c.hidden_size, inter=c.moe_intermediate_size,
                           experts=c.n_routed_experts, top_k=c.num_experts_per_tok, shared_experts=c.n_shared_experts,
                           activation="silu", scoring="sigmoid", renormalize=c.norm_topk_prob,
                           shared_inter=c.moe_intermediate_size if c.n_shared_experts else 0)


ARCHITECTURE = Glm4MoeArchitecture()
