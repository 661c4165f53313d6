"""Qwen3-MoE (Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B, ...): a Llama-style decoder with q/k norm and sparse MoE MLPs.

    input_ids [B, T] -> embed -> N x [x += attn(norm(x)); x += mlp(norm(x))] -> norm -> lm_head -> logits [B, T, V]

With an AttentionContext (the engine): input_ids [T] are the flat new tokens of several sequences, attention
reads and writes the paged KV cache, and logits come only for the rows in `logits_indices` (one per sampling
sequence), float32 [len(logits_indices), V].

mlp is a MoEBlock (router + cpumoe.FusedMoE, softmax top-k, renormalized when norm_topk_prob) on layers
l with (l + 1) % decoder_sparse_step == 0 and l not in mlp_only_layers; a dense GatedMLP elsewhere.
Module names follow the checkpoint's, so every parameter loads from the tensor of the same name;
`expert_weights` says how the per-expert tensors stack into FusedMoE's w13 / w2.
Config: https://huggingface.co/docs/transformers/model_doc/qwen3_moe
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from cpumoe.loader import Checkpoint, CheckpointError
from cpumoe.models.blocks import Attention, AttentionContext, ExpertWeights, GatedMLP, MoEBlock, RMSNorm


@dataclass(slots=True)
class Qwen3MoeConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense layers
    moe_intermediate_size: int  # each expert
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> "Qwen3MoeConfig":
        get = ckpt.config_get
        act = get("hidden_act", default="silu")
        if act != "silu":
            raise CheckpointError(f"{ckpt.path}: hidden_act {act!r} is not supported (silu only)")
        if get("use_sliding_window", default=False):
            raise CheckpointError(f"{ckpt.path}: sliding-window attention is not supported yet")
        rope = get("rope_parameters", "rope_scaling", default=None) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise CheckpointError(f"{ckpt.path}: rope type {rope.get('rope_type', rope.get('type'))!r} is not "
                                  "supported yet (default RoPE only)")
        heads = get("num_attention_heads")
        return cls(
            vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_hidden_layers=get("num_hidden_layers"),
            num_attention_heads=heads, num_key_value_heads=get("num_key_value_heads", default=heads),
            head_dim=get("head_dim", default=None) or get("hidden_size") // heads,
            intermediate_size=get("intermediate_size"), moe_intermediate_size=get("moe_intermediate_size"),
            # transformers 5 writes num_local_experts; published checkpoints say num_experts
            num_experts=get("num_experts", "num_local_experts"), num_experts_per_tok=get("num_experts_per_tok"),
            norm_topk_prob=get("norm_topk_prob", default=False),
            decoder_sparse_step=get("decoder_sparse_step", default=1),
            mlp_only_layers=list(get("mlp_only_layers", default=[]) or []),
            rms_norm_eps=get("rms_norm_eps", default=1e-6),
            rope_theta=rope.get("rope_theta", get("rope_theta", default=10000.0)),
            attention_bias=get("attention_bias", default=False),
            tie_word_embeddings=get("tie_word_embeddings", default=False),
        )

    def is_moe_layer(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, layer: int, backend: str):
        super().__init__()
        c = config
        self.layer_idx = layer
        self.self_attn = Attention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                                   num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                                   qk_norm=True, norm_eps=c.rms_norm_eps, bias=c.attention_bias)
        if c.is_moe_layer(layer):
            self.mlp = MoEBlock(hidden_size=c.hidden_size, num_experts=c.num_experts,
                                inter_size=c.moe_intermediate_size, top_k=c.num_experts_per_tok,
                                renormalize=c.norm_topk_prob, backend=backend)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                context: AttentionContext | None = None) -> torch.Tensor:  # x [B, T, H] or, with context, [T, H]
        x = x + self.self_attn(self.input_layernorm(x), positions, context, self.layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeModel(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, backend: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        # no context: [B, T] -> [B, T, H]; with context: flat [T] -> [T, H]
        positions = torch.arange(input_ids.shape[-1]) if context is None else context.positions  # [T]
        x = self.embed_tokens(input_ids)  # [B, T, H] or [T, H]
        for layer in self.layers:
            x = layer(x, positions, context)
        return self.norm(x)


class Qwen3MoeForCausalLM(nn.Module):
    config_class = Qwen3MoeConfig
    # Declarative weight loading: every parameter loads from the checkpoint tensor of its own name; each
    # MoEBlock's experts stack from these (names relative to the block, e.g. "model.layers.3.mlp").
    expert_weights = {
        "w13": ExpertWeights(per_expert=("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight"),
                             fused="experts.gate_up_proj"),  # [E, 2I, H]
        "w2": ExpertWeights(per_expert=("experts.{e}.down_proj.weight",), fused="experts.down_proj"),  # [E, H, I]
    }

    def __init__(self, config: Qwen3MoeConfig, backend: str = "auto"):
        super().__init__()
        self.config = config
        self.model = Qwen3MoeModel(config, backend)
        # tied: logits use embed_tokens.weight; the checkpoint's lm_head.weight, if any, is not read
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, context: AttentionContext | None = None,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """No context: [B, T] or [T] -> float32 [B, T, V] or [T, V], the whole sequence without a cache.
        With context: flat [T] -> float32 [len(logits_indices), V] (all T rows when logits_indices is None)."""
        if context is not None:
            h = self.model(input_ids, context)  # [T, H]
            return self.compute_logits(h if logits_indices is None else h[logits_indices])
        squeeze = input_ids.dim() == 1
        ids = input_ids[None] if squeeze else input_ids  # [B, T]
        logits = self.compute_logits(self.model(ids))  # [B, T, V]
        return logits[0] if squeeze else logits

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> float32 [..., V]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [V, H]
        return torch.nn.functional.linear(h, weight).float()
