"""The one decoder behind every MoE model here (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): a Llama-style stack whose
MLPs are MoE blocks. Architectures differ only in an ArchSpec (config field names, q/k norm, attention biases,
MoE module and expert names, shared expert, routing default); each per-architecture file holds just its spec.

    input_ids [B, T] -> embed -> N x [x += attn(norm(x)); x += mlp(norm(x))] -> norm -> lm_head -> logits [B, T, V]

With an AttentionContext (the engine): input_ids [T] are the flat new tokens of several sequences, attention
reads and writes the paged KV cache, and logits come only for the rows in `logits_indices` (one per sampling
sequence), float32 [len(logits_indices), V].

The MLP of layer l is a MoEBlock (router + cpumoe.FusedMoE, softmax top-k, renormalized when norm_topk_prob, plus
a gated shared expert where the spec has one) if (l + 1) % decoder_sparse_step == 0 and l not in mlp_only_layers;
a dense GatedMLP named "mlp" elsewhere. Module names follow the checkpoint's, so every parameter loads from the
tensor of the same name; `expert_weights` says how the per-expert tensors stack into FusedMoE's w13 / w2.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from cpumoe.loader import Checkpoint, CheckpointError
from cpumoe.models.blocks import Attention, AttentionContext, ExpertWeights, GatedMLP, MoEBlock, QKNorm, RMSNorm
from cpumoe.models.packed_linear import PackedLinear, QuantizedLinear
from cpumoe.models.rope import rope_from_config


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """Where one architecture departs from the shared decoder.

    qk_norm: q/k RMSNorm kind. bias_field: the config flag for q/k/v (and, if o_bias, o_proj) biases, read with
    default bias_default; None: never biased. moe: the MoE module's name in a layer; experts: per-expert gate, up,
    down projection names under "{moe}.experts.{e}."; expert_inter_field: the config field of one expert's I.
    norm_topk_prob: its default when config.json does not say. shared_expert: a sigmoid-gated shared expert of
    shared_expert_intermediate_size.
    """
    qk_norm: QKNorm = QKNorm.NONE
    bias_field: str | None = "attention_bias"
    bias_default: bool = False
    o_bias: bool = True
    moe: str = "mlp"
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    expert_inter_field: str = "intermediate_size"
    norm_topk_prob: bool = False
    shared_expert: bool = False


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
    def from_checkpoint(cls, ckpt: Checkpoint, spec: ArchSpec) -> "MoeDecoderConfig":
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


def _check_no_sliding_window(ckpt: Checkpoint) -> None:
    """Full causal attention only. Qwen configs carry a sliding_window that is off unless use_sliding_window;
    Mixtral's is on whenever set (Mixtral-8x7B: null); layer_types may name sliding layers (transformers 5)."""
    get = ckpt.config_get
    use = get("use_sliding_window", default=None)
    window = get("sliding_window", default=None)
    sliding_layers = "sliding_attention" in (get("layer_types", default=None) or [])
    if use or sliding_layers or (use is None and window):
        raise CheckpointError(f"{ckpt.path}: sliding-window attention (sliding_window={window}) is not supported "
                              "yet; cpumoe attends over the whole context")


class DecoderLayer(nn.Module):
    def __init__(self, config: MoeDecoderConfig, spec: ArchSpec, layer: int, backend: str):
        super().__init__()
        c = config
        self.layer_idx = layer
        self.self_attn = Attention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                                   num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                                   qk_norm=spec.qk_norm, norm_eps=c.rms_norm_eps, qkv_bias=c.qkv_bias,
                                   o_bias=c.o_bias, clip_qkv=c.clip_qkv, rope_scaling=c.rope_scaling)
        if c.is_moe_layer(layer):
            self.mlp_name = spec.moe
            mlp: nn.Module = MoEBlock(hidden_size=c.hidden_size, num_experts=c.num_experts,
                                      inter_size=c.moe_intermediate_size, top_k=c.num_experts_per_tok,
                                      renormalize=c.norm_topk_prob,
                                      shared_inter_size=c.shared_expert_intermediate_size, backend=backend)
        else:
            self.mlp_name = "mlp"
            mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.add_module(self.mlp_name, mlp)  # "mlp", or Mixtral's "block_sparse_moe"
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                context: AttentionContext | None = None) -> torch.Tensor:  # x [B, T, H] or, with context, [T, H]
        x = x + self.self_attn(self.input_layernorm(x), positions, context, self.layer_idx)
        return x + self.get_submodule(self.mlp_name)(self.post_attention_layernorm(x))


class MoeDecoderModel(nn.Module):
    def __init__(self, config: MoeDecoderConfig, spec: ArchSpec, backend: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, spec, i, backend) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        # no context: [B, T] -> [B, T, H]; with context: flat [T] -> [T, H]
        positions = torch.arange(input_ids.shape[-1]) if context is None else context.positions  # [T]
        x = self.embed_tokens(input_ids)  # [B, T, H] or [T, H]
        for layer in self.layers:
            x = layer(x, positions, context)
        return self.norm(x)


class MoeDecoderForCausalLM(nn.Module):
    """Subclasses set `spec`; load_model builds them from `config_from_checkpoint`."""
    spec: ClassVar[ArchSpec]

    def __init__(self, config: MoeDecoderConfig, backend: str = "auto"):
        super().__init__()
        self.config = config
        self.model = MoeDecoderModel(config, self.spec, backend)
        # tied: logits use embed_tokens.weight; the checkpoint's lm_head.weight, if any, is not read
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def config_from_checkpoint(cls, ckpt: Checkpoint) -> MoeDecoderConfig:
        return MoeDecoderConfig.from_checkpoint(ckpt, cls.spec)

    @property
    def expert_weights(self) -> dict[str, ExpertWeights]:
        """Declarative expert loading: every other parameter loads from the checkpoint tensor of its own name; each
        MoEBlock's experts stack from these (names relative to the block, e.g. "model.layers.3.mlp")."""
        gate, up, down = self.spec.experts
        return {
            "w13": ExpertWeights(per_expert=(f"experts.{{e}}.{gate}.weight", f"experts.{{e}}.{up}.weight"),
                                 fused="experts.gate_up_proj"),  # [E, 2I, H]
            "w2": ExpertWeights(per_expert=(f"experts.{{e}}.{down}.weight",), fused="experts.down_proj"),  # [E, H, I]
        }

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

    def make_batch_invariant(self) -> None:
        """Make every token's result independent of the other tokens in its step and of how its prompt is chunked
        (the engine's batch_invariant): attention runs as blocks.row_attention, and the products that torch's GEMMs
        would compute (float32 routers, MLA's absorbed heads, a tied lm_head) get copies packed for cpumoe's linear
        kernel, whose rows never depend on how many there are. The experts and the packed projections are so
        already. Each module that needs it has a make_batch_invariant of its own."""
        torch_gemms = [name for name, m in self.named_modules() if type(m) is nn.Linear
                       or (isinstance(m, QuantizedLinear) and m.packed_weight is None)]
        if torch_gemms:
            raise ValueError(f"batch invariance needs cpumoe's kernels for every projection; {torch_gemms[0]} runs on "
                             "torch's GEMM (backend 'naive', or a dtype or format no native path takes)")
        for module in [m for m in self.modules() if m is not self and hasattr(m, "make_batch_invariant")]:
            module.make_batch_invariant()
        if self.lm_head is None:
            self.lm_head = PackedLinear(self.model.embed_tokens.weight)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> float32 [..., V]
        if self.lm_head is None:  # tied to the embedding table [V, H]
            return torch.nn.functional.linear(h, self.model.embed_tokens.weight).float()
        return self.lm_head(h).float()
