"""The Llama-style MoE decoder behind Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE. These architectures differ only in
the class attributes of a MoeDecoderArchitecture (config field names, q/k norm, attention biases, MoE module and
expert names, shared expert, routing default); each per-architecture file holds just those, its presets and its
tiny config.

    input_ids -> embed -> N x [x += attn(norm(x)); x += mlp(norm(x))] -> norm -> lm_head -> logits

The MLP of layer l is a MoEBlock (router + cpumoe.FusedMoE, softmax top-k, renormalized when norm_topk_prob, plus
a gated shared expert where the architecture has one) if (l + 1) % decoder_sparse_step == 0 and l not in
mlp_only_layers; a dense GatedMLP named "mlp" elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from cpumoe.loader import CheckpointConfig, CheckpointError
from cpumoe.models.architecture import Architecture, DecoderLayer, ModelPreset
from cpumoe.models.blocks import Attention, GatedMLP, MoEBlock, QKNorm, RMSNorm
from cpumoe.models.rope import rope_from_config


@dataclass(slots=True)
class MoeDecoderConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int  # each routed expert
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    intermediate_size: int = 0  # dense layers
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # rope.rope_from_config's normalized dict; None: default RoPE
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None
    tie_word_embeddings: bool = False

    @classmethod
    def from_checkpoint(cls, ckpt: CheckpointConfig, spec: "MoeDecoderArchitecture") -> "MoeDecoderConfig":
        get = ckpt.config_get
        act = get("hidden_act", default="silu")
        if act != "silu":
            raise CheckpointError(f"{ckpt.path}: hidden_act {act!r} is not supported (silu only)")
        _check_no_sliding_window(ckpt)
        try:
            rope_theta, rope_scaling = rope_from_config(ckpt.config)
        except ValueError as e:
            raise CheckpointError(f"{ckpt.path}: {e}") from None
        heads = get("num_attention_heads")
        bias = bool(get(spec.bias_field, default=spec.bias_default)) if spec.bias_field else False
        return cls(
            vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_hidden_layers=get("num_hidden_layers"),
            num_attention_heads=heads, num_key_value_heads=get("num_key_value_heads", default=heads),
            head_dim=get("head_dim", default=None) or get("hidden_size") // heads,
            moe_intermediate_size=get(spec.expert_inter_field),
            # transformers 5 writes num_local_experts for some; published checkpoints may say num_experts
            num_experts=get("num_experts", "num_local_experts"), num_experts_per_tok=get("num_experts_per_tok"),
            norm_topk_prob=get("norm_topk_prob", default=spec.norm_topk_prob),
            intermediate_size=get("intermediate_size", default=0),
            shared_expert_intermediate_size=get("shared_expert_intermediate_size") if spec.shared_expert else 0,
            decoder_sparse_step=get("decoder_sparse_step", default=1) or 1,
            mlp_only_layers=list(get("mlp_only_layers", default=[]) or []),
            rms_norm_eps=get("rms_norm_eps", default=1e-6),
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            qkv_bias=bias, o_bias=bias and spec.o_bias, clip_qkv=get("clip_qkv", default=None),
            tie_word_embeddings=get("tie_word_embeddings", default=False),
        )

    def is_moe_layer(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


def _check_no_sliding_window(ckpt: CheckpointConfig) -> None:
    """Full causal attention only. Qwen configs carry a sliding_window that is off unless use_sliding_window;
    Mixtral's is on whenever set (Mixtral-8x7B: null); layer_types may name sliding layers (transformers 5)."""
    get = ckpt.config_get
    use = get("use_sliding_window", default=None)
    window = get("sliding_window", default=None)
    sliding_layers = "sliding_attention" in (get("layer_types", default=None) or [])
    if use or sliding_layers or (use is None and window):
        raise CheckpointError(f"{ckpt.path}: sliding-window attention (sliding_window={window}) is not supported "
                              "yet; cpumoe attends over the whole context")


class MoeDecoderArchitecture(Architecture):
    """Where one architecture departs from the shared decoder.

    qk_norm: q/k RMSNorm kind. bias_field: the config flag for q/k/v (and, if o_bias, o_proj) biases, read with
    default bias_default; None: never biased. moe: the MoE module's name in a layer; expert_projections (see
    Architecture): per-expert gate, up, down names under "{moe}.experts.{e}."; expert_inter_field: the config field
    of one expert's I; experts_field: the config field of E. norm_topk_prob: its default when config.json does not say. shared_expert: a sigmoid-gated
    shared expert of shared_expert_intermediate_size.
    """
    qk_norm: ClassVar[QKNorm] = QKNorm.NONE
    bias_field: ClassVar[str | None] = "attention_bias"
    bias_default: ClassVar[bool] = False
    o_bias: ClassVar[bool] = True
    moe: ClassVar[str] = "mlp"
    expert_inter_field: ClassVar[str] = "intermediate_size"
    experts_field: ClassVar[str] = "num_experts"
    norm_topk_prob: ClassVar[bool] = False
    shared_expert: ClassVar[bool] = False

    def config(self, ckpt: CheckpointConfig) -> MoeDecoderConfig:
        return MoeDecoderConfig.from_checkpoint(ckpt, self)

    def layer(self, config: MoeDecoderConfig, index: int, backend: str) -> nn.Module:
        c = config
        attention = Attention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                              num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                              qk_norm=self.qk_norm, norm_eps=c.rms_norm_eps, qkv_bias=c.qkv_bias, o_bias=c.o_bias,
                              clip_qkv=c.clip_qkv, rope_scaling=c.rope_scaling)
        if c.is_moe_layer(index):
            mlp: nn.Module = MoEBlock(hidden_size=c.hidden_size, num_experts=c.num_experts,
                                      inter_size=c.moe_intermediate_size, top_k=c.num_experts_per_tok,
                                      renormalize=c.norm_topk_prob,
                                      shared_inter_size=c.shared_expert_intermediate_size, backend=backend)
            mlp_name = self.moe
        else:
            mlp, mlp_name = GatedMLP(c.hidden_size, c.intermediate_size), "mlp"
        return DecoderLayer(index, self_attn=attention, mlp=mlp, mlp_name=mlp_name,
                            input_layernorm=RMSNorm(c.hidden_size, c.rms_norm_eps),
                            post_attention_layernorm=RMSNorm(c.hidden_size, c.rms_norm_eps))

    def layer_shape_config(self, *, hidden: int, inter: int, experts: int, top_k: int) -> dict:
        return {"hidden_size": hidden, self.expert_inter_field: inter, self.experts_field: experts,
                "num_experts_per_tok": top_k}

    def layer_preset(self, preset: ModelPreset):
        from cpumoe.presets import LayerPreset
        c = self.preset_config(preset)
        shared = c.shared_expert_intermediate_size
        return LayerPreset(preset.name, hidden=c.hidden_size, inter=c.moe_intermediate_size, experts=c.num_experts,
                           top_k=c.num_experts_per_tok, shared_experts=int(shared > 0), activation="silu",
                           scoring="softmax", renormalize=c.norm_topk_prob, shared_inter=shared)


