"""DeepSeek-V2 (model_type "deepseek_v2": DeepSeek-V2, -V2-Lite, -V2-Chat), as transformers' DeepseekV2ForCausalLM.

    input_ids -> embed -> N x [x += MLA(norm(x)); x += mlp(norm(x))] -> norm -> lm_head -> logits

Where it departs from the Llama-style decoder (its layers are the shared DecoderLayer over these modules):
- attention is multi-head latent attention (mla.py), with interleaved RoPE on the rope channels only; the engine's
  cache holds its compressed latent and rope key per token (config.kv_cache_layout), not per-head K and V;
- layers l < first_k_dense_replace have a dense GatedMLP of intermediate_size, the others a DeepseekV2MoE:
  router in float32 -> softmax -> top-k ("greedy"), or top-k within the topk_group best of n_group groups, a
  group scored by its best expert ("group_limited_greedy") -> weights * routed_scaling_factor, never renormalized
  (transformers' DeepseekV2 ignores norm_topk_prob; so do we) -> + an ungated shared MLP of
  moe_intermediate_size * n_shared_experts.
RoPE: default, or scaled as rope.py supports (the published V2 checkpoints use yarn: factor 40 over 4096 original
positions, mscale = mscale_all_dim = 0.707), applied as transformers' DeepseekV2 does (see mla.py); other types are
refused with a CheckpointError.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cpumoe.attention import KVCacheLayout
from cpumoe.layer import FusedMoE
from cpumoe.loader import CheckpointConfig, CheckpointError
from cpumoe.models.architecture import Architecture, DecoderLayer, ModelPreset
from cpumoe.models.blocks import GatedMLP, MoEBlock, RMSNorm
from cpumoe.models.mla import MLAttention
from cpumoe.models.packed_linear import PackedLinear
from cpumoe.models.rope import rope_from_config

TOPK_METHODS = ("greedy", "group_limited_greedy")
# config.json fields read with a default when absent; DeepSeek-V3 passes its own (transformers' DeepseekV3Config's)
DEFAULTS = dict(n_routed_experts=0, n_shared_experts=0, first_k_dense_replace=0, q_lora_rank=None,
                topk_method="greedy", n_group=None, topk_group=None, routed_scaling_factor=1.0)


@dataclass(slots=True)
class DeepseekV2Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int  # dense layers
    moe_intermediate_size: int  # each routed expert
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # rope.rope_from_config's normalized dict; None: default RoPE
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    rope_interleave: bool = True  # RoPE on pairs (x[2i], x[2i+1]); DeepSeek-V3's config may say halves (False)

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    def moe_block(self, backend: str) -> MoEBlock:
        """The MLP of a MoE layer (DeepSeek-V3's config builds its own router here)."""
        grouped = self.topk_method == "group_limited_greedy"
        return DeepseekV2MoE(
            hidden_size=self.hidden_size, num_experts=self.n_routed_experts, inter_size=self.moe_intermediate_size,
            top_k=self.num_experts_per_tok, shared_inter_size=self.moe_intermediate_size * self.n_shared_experts,
            num_expert_group=self.n_group if grouped else None, topk_group=self.topk_group if grouped else None,
            routed_scaling_factor=self.routed_scaling_factor, backend=backend)

    @classmethod
    def from_checkpoint(cls, ckpt: CheckpointConfig) -> "DeepseekV2Config":
        return cls(**config_fields(ckpt, TOPK_METHODS, DEFAULTS))


def config_fields(ckpt: CheckpointConfig, topk_methods: tuple[str, ...], defaults: dict) -> dict:
    """DeepseekV2Config's fields from config.json (shared with DeepSeek-V3): topk_method must be one of topk_methods;
    `defaults` hold the values of the DEFAULTS fields when config.json does not have them."""
    get = ckpt.config_get
    d = defaults
    if (act := get("hidden_act", default="silu")) != "silu":
        raise CheckpointError(f"{ckpt.path}: hidden_act {act!r} is not supported (silu only)")
    if get("mlp_bias", default=False):
        raise CheckpointError(f"{ckpt.path}: mlp_bias is not supported")
    try:
        rope_theta, rope_scaling = rope_from_config(ckpt.config)
    except ValueError as e:
        raise CheckpointError(f"{ckpt.path}: {e}") from None
    method = get("topk_method", default=d["topk_method"]) or d["topk_method"]
    if method not in topk_methods:
        raise CheckpointError(f"{ckpt.path}: topk_method {method!r} is not supported; expected one of {topk_methods}")
    return dict(
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=get("num_attention_heads"), intermediate_size=get("intermediate_size"),
        moe_intermediate_size=get("moe_intermediate_size"),
        n_routed_experts=get("n_routed_experts", default=d["n_routed_experts"]) or 0,
        num_experts_per_tok=get("num_experts_per_tok"),
        n_shared_experts=get("n_shared_experts", default=d["n_shared_experts"]) or 0,
        first_k_dense_replace=get("first_k_dense_replace", default=d["first_k_dense_replace"]),
        kv_lora_rank=get("kv_lora_rank"), q_lora_rank=get("q_lora_rank", default=d["q_lora_rank"]),
        qk_nope_head_dim=get("qk_nope_head_dim"), qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"), topk_method=method, n_group=get("n_group", default=d["n_group"]),
        topk_group=get("topk_group", default=d["topk_group"]),
        routed_scaling_factor=get("routed_scaling_factor", default=d["routed_scaling_factor"]),
        rms_norm_eps=get("rms_norm_eps", default=1e-6),
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        attention_bias=bool(get("attention_bias", default=False)),
        tie_word_embeddings=get("tie_word_embeddings", default=False),
    )


class DeepseekV2TopkRouter(nn.Module):
    """The router's weight under transformers' name (mlp.gate.weight [E, H]), float32 whatever the model dtype, as
    transformers keeps it (_keep_in_fp32_modules_strict); the routing itself is FusedMoE's (select_experts). Not an
    nn.Linear: pack_linears would pack the weight in the model dtype."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.packed: PackedLinear | None = None  # batch-invariant: the weight on cpumoe's float32 linear kernel

    def make_batch_invariant(self) -> None:
        self.packed = PackedLinear(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M, E] float32, as transformers
        return F.linear(x.float(), self.weight) if self.packed is None else self.packed(x.float())

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


class DeepseekV2MoE(MoEBlock):
    """MoEBlock with DeepSeek-V2's router (float32 logits, optional group-limited top-k, scaled, not renormalized)
    and an ungated shared MLP `shared_experts` (checkpoint names mlp.gate / mlp.experts.{e} / mlp.shared_experts).
    scoring and renormalize are for DeepSeek-V3's subclass (sigmoid; renormalized when norm_topk_prob)."""

    def __init__(self, *, hidden_size: int, num_experts: int, inter_size: int, top_k: int, shared_inter_size: int,
                 num_expert_group: int | None, topk_group: int | None, routed_scaling_factor: float,
                 scoring: str = "softmax", renormalize: bool = False, backend: str = "auto"):
        super().__init__(hidden_size=hidden_size, num_experts=num_experts, inter_size=inter_size, top_k=top_k,
                         renormalize=renormalize, backend=backend)
        self.gate = DeepseekV2TopkRouter(hidden_size, num_experts)
        self.shared_experts = GatedMLP(hidden_size, shared_inter_size) if shared_inter_size else None
        self.routing = dict(scoring=scoring, num_expert_group=num_expert_group, topk_group=topk_group,
                            routed_scaling_factor=routed_scaling_factor)

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor, expert_reader=None, dtype=None) -> None:  # see MoEBlock
        self.experts = FusedMoE(w13, w2, top_k=self.top_k, renormalize=self.renormalize, backend=self.backend,
                                expert_reader=expert_reader, dtype=dtype, **self.routing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H]
        if self.experts is None:
            raise RuntimeError("DeepseekV2MoE has no experts yet: load the model with cpumoe.models.load_model")
        flat = x.reshape(-1, x.shape[-1])  # [M, H]
        router_logits = self.gate(flat)  # [M, E] float32
        out = self.experts(flat, router_logits)  # [M, H]
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(x.shape)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in {**self.routing, "renormalize": self.renormalize}.items())


class DeepseekV2Architecture(Architecture):
    """DeepSeek-V2's layers are the shared DecoderLayer over MLA and its MoE (or a dense MLP in the first layers);
    the engine's cache holds MLA's latent (kv_cache_layout)."""
    model_type = "deepseek_v2"
    hf_name = "DeepseekV2"
    fp32_parameters = ("mlp.gate.weight",)
    presets = (
        ModelPreset("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", dict(
            num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
            vocab_size=102400, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
            n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy", n_group=1,
            topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, rms_norm_eps=1e-6,
            max_position_embeddings=163840, tie_word_embeddings=False, attention_bias=False, rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707))),
    )
    tiny = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                routed_scaling_factor=1.5, max_position_embeddings=512,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0))

    def config(self, ckpt: CheckpointConfig) -> DeepseekV2Config:
        return DeepseekV2Config.from_checkpoint(ckpt)

    def layer(self, config: DeepseekV2Config, index: int, backend: str) -> nn.Module:
        c = config
        attention = MLAttention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                                kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                                qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                                rope_theta=c.rope_theta, bias=c.attention_bias, rope_scaling=c.rope_scaling,
                                rope_interleave=c.rope_interleave)
        mlp = c.moe_block(backend) if c.is_moe_layer(index) else GatedMLP(c.hidden_size, c.intermediate_size)
        return DecoderLayer(index, self_attn=attention, mlp=mlp,
                            input_layernorm=RMSNorm(c.hidden_size, c.rms_norm_eps),
                            post_attention_layernorm=RMSNorm(c.hidden_size, c.rms_norm_eps))

    def kv_cache_layout(self, config: DeepseekV2Config) -> KVCacheLayout:
        """MLA's latent and rope key per token and layer, no per-head K or V."""
        return MLAttention.cache_layout(config.kv_lora_rank, config.qk_rope_head_dim)

    def layer_shape_config(self, *, hidden: int, inter: int, experts: int, top_k: int) -> dict:
        # one group: any expert count routes, whatever n_group the real model has
        return dict(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                    num_experts_per_tok=top_k, n_group=1, topk_group=1)

    def layer_preset(self, preset: ModelPreset):
        from cpumoe.presets import LayerPreset
        c = self.preset_config(preset)
        with torch.device("meta"):  # only its routing is read
            block = c.moe_block("auto")
        return LayerPreset(preset.name, hidden=c.hidden_size, inter=c.moe_intermediate_size,
                           experts=c.n_routed_experts, top_k=c.num_experts_per_tok, shared_experts=c.n_shared_experts,
                           activation="silu", scoring=block.routing["scoring"], renormalize=block.renormalize,
                           shared_inter=c.moe_intermediate_size if c.n_shared_experts else 0)


ARCHITECTURE = DeepseekV2Architecture()
