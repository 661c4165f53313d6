"""DeepSeek-V2 (model_type "deepseek_v2": DeepSeek-V2, -V2-Lite, -V2-Chat), as transformers' DeepseekV2ForCausalLM.

    input_ids -> embed -> N x [x += MLA(norm(x)); x += mlp(norm(x))] -> norm -> lm_head -> logits

Where it departs from the shared decoder (moe_decoder.py), whose embedding, layer loop, final norm, forward and
logits it reuses:
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
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cpumoe.engine.kv_cache import KVCacheLayout
from cpumoe.layer import FusedMoE
from cpumoe.loader import Checkpoint, CheckpointError
from cpumoe.models.blocks import AttentionContext, GatedMLP, MoEBlock, RMSNorm
from cpumoe.models.mla import MLAttention
from cpumoe.models.moe_decoder import ArchSpec, MoeDecoderForCausalLM, MoeDecoderModel
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

    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        """What the engine's KVCache holds per token and layer: MLA's latent and rope key, no per-head K or V."""
        return MLAttention.cache_layout(self.kv_lora_rank, self.qk_rope_head_dim)

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
    def from_checkpoint(cls, ckpt: Checkpoint) -> "DeepseekV2Config":
        return cls(**config_fields(ckpt, TOPK_METHODS, DEFAULTS))


def config_fields(ckpt: Checkpoint, topk_methods: tuple[str, ...], defaults: dict) -> dict:
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


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV2Config, layer: int, backend: str):
        super().__init__()
        c = config
        self.layer_idx = layer
        self.self_attn = MLAttention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                                     q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                                     qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                                     v_head_dim=c.v_head_dim, rope_theta=c.rope_theta, bias=c.attention_bias,
                                     rope_scaling=c.rope_scaling, rope_interleave=c.rope_interleave)
        if c.is_moe_layer(layer):
            self.mlp: nn.Module = c.moe_block(backend)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                context: AttentionContext | None = None) -> torch.Tensor:  # x [B, T, H] or, with context, [T, H]
        x = x + self.self_attn(self.input_layernorm(x), positions, context, self.layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV2Model(MoeDecoderModel):
    """MoeDecoderModel's embed -> layers -> norm forward over DeepSeek-V2 layers. Its __init__ builds Llama-style
    layers, so this one replaces it (nn.Module.__init__ only) and sets the same three submodules."""

    def __init__(self, config: DeepseekV2Config, backend: str):
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(config, i, backend) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV2ForCausalLM(MoeDecoderForCausalLM):
    """Reuses MoeDecoderForCausalLM's forward, compute_logits and expert_weights (experts.{e}.gate_proj / up_proj /
    down_proj, or transformers' fused experts.gate_up_proj / down_proj); builds its own model."""
    spec: ClassVar[ArchSpec] = ArchSpec(moe="mlp", experts=("gate_proj", "up_proj", "down_proj"))
    fp32_parameters: ClassVar[tuple[str, ...]] = ("mlp.gate.weight",)

    def __init__(self, config: DeepseekV2Config, backend: str = "auto"):
        nn.Module.__init__(self)
        self.config = config
        self.model = DeepseekV2Model(config, backend)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def config_from_checkpoint(cls, ckpt: Checkpoint) -> DeepseekV2Config:  # type: ignore[override]
        return DeepseekV2Config.from_checkpoint(ckpt)
