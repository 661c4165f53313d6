"""Phi-3.5-MoE (model_type "phimoe": microsoft/Phi-3.5-MoE-instruct), as transformers' PhimoeForCausalLM.

    input_ids -> embed -> N x [x += attn(norm(x)); x += block_sparse_moe(norm(x))] -> norm -> lm_head -> logits

Where it departs from the Llama-style decoder (its layers are the shared DecoderLayer over these modules):
- LayerNorm, not RMSNorm: input_layernorm, post_attention_layernorm and model.norm subtract the mean and have a
  bias (torch's nn.LayerNorm, eps = config.json's rms_norm_eps, as transformers builds them);
- q/k/v/o biased when attention_bias; the lm_head has a bias when lm_head_bias (both true in the published model);
- RoPE "longrope" (config.json rope_scaling, Phi-3 style): inv_freq[i] = 1 / (short_factor[i] * theta^(2i/d)) and
  cos/sin scaled by short_mscale. transformers 5.24's PhimoeRotaryEmbedding computes exactly that at every length:
  its forward rebuilds inv_freq from the short factors without the sequence length, and switches to long_mscale
  only past original_max_position_embeddings, so long_factor never takes part (the Phi-3 family's own modeling
  code switches the whole sequence to long_factor past that length instead, re-rotating every cached key, which a
  paged cache cannot follow). cpumoe follows transformers, and refuses short_mscale != long_mscale, the one case
  where the per-call switch would change cos/sin mid-sequence. rope_theta defaults to 1e6 (PhimoeConfig's);
- every query sees its last `sliding_window` keys when sliding_window is set (the published model: 131072, its
  whole context);
- every layer is MoE: router block_sparse_moe.gate (no bias, the model dtype), experts
  block_sparse_moe.experts.{e}.w1 / w3 / w2 (gate / up / down) of intermediate_size, silu; routing is sparsemixer
  (below), always two experts a token, weights that are not renormalized.
input_jitter_noise is training-only (it jitters the router's input), and sparsemixer's Gumbel sampling and gradient
estimator are too; neither has a part at inference. Refused with a CheckpointError: hidden_act other than silu,
num_experts_per_tok other than 2, fewer than 2 experts, a negative router_jitter_noise, RoPE types other than
default and longrope, malformed longrope parameters, partial rotary, a non-positive sliding_window, and a tied
lm_head with a bias.
Config: https://huggingface.co/docs/transformers/model_doc/phimoe
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cpumoe.loader import CheckpointConfig, CheckpointError
from cpumoe.models.architecture import Architecture, DecoderLayer, ModelPreset
from cpumoe.models.blocks import Attention, MoEBlock, QKNorm, RotaryEmbedding
from cpumoe.models.rope import rope_type

DEFAULT_ROPE_THETA = 1e6  # PhimoeConfig.default_theta, for a config.json without rope_theta
TOP_K = 2  # sparsemixer picks exactly two experts, whatever num_experts_per_tok says
ROPE_TYPES = ("default", "longrope")


def sparsemixer(router_logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-MoE's top-2 routing ("sparsemixer", https://arxiv.org/abs/2409.12136) as transformers runs it at
    inference: router_logits [M, E] -> weights float32 [M, 2], expert ids int32 [M, 2]. The maths stays in the
    logits' dtype, op for op as transformers' sparsemixer(training=False), so bf16 rounds where it rounds there.

    First expert: the largest logit m1 (ties: torch.max's pick). Every expert e with
    (m1 - s_e) / max(|s_e|, m1) <= 2 * jitter_eps (a logit within a relative 2 * jitter_eps of m1) is a candidate;
    the first weight is the first expert's softmax over the candidates alone, 1 when no other logit is that close.
    Second expert: the largest logit m2 of the others; the candidates are the experts other than the first with
    (m2 - s_e) / max(|s_e|, m2) <= 2 * jitter_eps, and the second weight is the second expert's softmax over them.
    The two weights are not renormalized: each is usually 1, and they need not sum to 1.
    """
    threshold = 2 * jitter_eps
    top1, first = router_logits.max(dim=-1, keepdim=True)  # [M, 1]
    far = (top1 - router_logits) / router_logits.abs().clamp(min=top1) > threshold  # [M, E]
    weight1 = router_logits.masked_fill(far, float("-inf")).softmax(dim=-1).gather(-1, first)  # [M, 1]
    others = router_logits.scatter(-1, first, float("-inf"))  # [M, E], the first expert out
    top2, second = others.max(dim=-1, keepdim=True)  # [M, 1]
    far = (top2 - router_logits) / router_logits.abs().clamp(min=top2) > threshold
    weight2 = others.masked_fill(far, float("-inf")).softmax(dim=-1).gather(-1, second)  # [M, 1]
    weights = torch.cat((weight1, weight2), dim=-1).float()  # [M, 2]
    return weights, torch.cat((first, second), dim=-1).to(torch.int32)


@dataclass(slots=True)
class PhimoeConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # each expert
    num_local_experts: int
    router_jitter_noise: float  # sparsemixer's jitter_eps: the candidates' relative margin is twice it
    rms_norm_eps: float  # the LayerNorms' eps (transformers' name for it)
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "longrope", "short_factor": [d/2], "short_mscale"}; None: default RoPE
    sliding_window: int | None
    attention_bias: bool
    lm_head_bias: bool
    tie_word_embeddings: bool
    num_experts_per_tok: int = TOP_K


def parse_config(ckpt: CheckpointConfig) -> PhimoeConfig:
    get = ckpt.config_get
    where = f"{ckpt.path}:"
    act = get("hidden_act", default="silu")
    if act != "silu":
        raise CheckpointError(f"{where} hidden_act {act!r} is not supported (silu only)")
    top_k = get("num_experts_per_tok", default=TOP_K)
    if top_k != TOP_K:
        raise CheckpointError(f"{where} num_experts_per_tok={top_k} is not supported: sparsemixer routes every token "
                              f"to exactly {TOP_K} experts")
    experts = get("num_local_experts")
    if not isinstance(experts, int) or experts < TOP_K:
        raise CheckpointError(f"{where} num_local_experts must be an integer >= {TOP_K}, got {experts!r}")
    jitter = get("router_jitter_noise", default=0.01)
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or jitter < 0:
        raise CheckpointError(f"{where} router_jitter_noise must be a number >= 0, got {jitter!r}")
    window = get("sliding_window", default=None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise CheckpointError(f"{where} sliding_window must be a positive integer or null, got {window!r}")
    heads = get("num_attention_heads")
    head_dim = get("head_dim", default=None) or get("hidden_size") // heads
    rope_theta, rope_scaling = parse_rope(ckpt, head_dim)
    lm_head_bias = bool(get("lm_head_bias", default=False))
    tied = bool(get("tie_word_embeddings", default=False))
    if tied and lm_head_bias:
        raise CheckpointError(f"{where} tie_word_embeddings with lm_head_bias is not supported (a tied lm_head is "
                              "the embedding table, without a bias)")
    return PhimoeConfig(
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=heads,
        # PhimoeConfig's default is 8 key-value heads; null means one per query head
        num_key_value_heads=get("num_key_value_heads", default=8) or heads,
        head_dim=head_dim, intermediate_size=get("intermediate_size"), num_local_experts=experts,
        router_jitter_noise=float(jitter), rms_norm_eps=get("rms_norm_eps", default=1e-5), rope_theta=rope_theta,
        rope_scaling=rope_scaling, sliding_window=window, attention_bias=bool(get("attention_bias", default=False)),
        lm_head_bias=lm_head_bias, tie_word_embeddings=tied,
    )


def parse_rope(ckpt: CheckpointConfig, head_dim: int) -> tuple[float, dict | None]:
    """(theta, scaling) as transformers' Phimoe reads config.json: the dict is rope_scaling (published configs) or
    rope_parameters (transformers 5); theta is its rope_theta, else the config's, else 1e6. scaling is None for
    default RoPE, else the longrope values the rotary uses (see the module docstring)."""
    config = ckpt.config
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise CheckpointError(f"{ckpt.path}: rope_scaling must be one flat object (not nested per layer type), "
                              f"got {rope!r}")
    theta = float(rope.get("rope_theta") or config.get("rope_theta") or DEFAULT_ROPE_THETA)
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"{ckpt.path}: partial_rotary_factor={partial} is not supported (RoPE on every channel)")
    kind = rope_type(rope)
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"{ckpt.path}: rope_scaling type {kind!r} is not supported for phimoe; supported: "
                              f"{', '.join(ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    if head_dim % 2:
        raise CheckpointError(f"{ckpt.path}: RoPE needs an even head_dim, got {head_dim}")
    for key in ("short_factor", "long_factor"):
        factors = rope.get(key)
        if not (isinstance(factors, list) and len(factors) == head_dim // 2
                and all(isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors)):
            raise CheckpointError(f"{ckpt.path}: rope_scaling {key} must be {head_dim // 2} positive numbers (one per "
                                  f"rotated channel pair), got {factors!r}")
    mscales = {}
    for key in ("short_mscale", "long_mscale"):
        value = rope.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{ckpt.path}: rope_scaling {key} must be a number, got {value!r}")
        mscales[key] = float(value)
    if mscales["short_mscale"] != mscales["long_mscale"]:
        raise CheckpointError(f"{ckpt.path}: rope_scaling long_mscale={mscales['long_mscale']} differs from "
                              f"short_mscale={mscales['short_mscale']}: transformers switches between them by the "
                              "longest position of each forward call, which keys already in a paged cache cannot "
                              "follow")
    return theta, {"rope_type": "longrope", "short_factor": [float(f) for f in rope["short_factor"]],
                   "short_mscale": mscales["short_mscale"]}


def long_rope(head_dim: int, theta: float, scaling: dict) -> RotaryEmbedding:
    """RotaryEmbedding with Phi-MoE's longrope: inv_freq[i] = 1 / (short_factor[i] * theta^(2i/d)), cos/sin times
    short_mscale; in float32 and in transformers' order of operations (_compute_longrope_parameters), so cos/sin
    agree with it bit for bit."""
    channels = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim  # [d/2]
    factors = torch.tensor(scaling["short_factor"], dtype=torch.float32, device="cpu")  # [d/2]
    return RotaryEmbedding(head_dim, theta, scaling,
                           frequencies=(1.0 / (factors * theta ** channels), scaling["short_mscale"]))


class SparseMixerMoE(MoEBlock):
    """MoEBlock whose router logits go through `sparsemixer` (two experts, their own weights) and then straight to
    the experts (FusedMoE.experts): FusedMoE's own routing, select_experts, has no sparsemixer."""

    def __init__(self, *, hidden_size: int, num_experts: int, inter_size: int, jitter_eps: float,
                 backend: str = "auto"):
        super().__init__(hidden_size=hidden_size, num_experts=num_experts, inter_size=inter_size, top_k=TOP_K,
                         renormalize=False, backend=backend)
        self.jitter_eps = jitter_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H]
        if self.experts is None:
            raise RuntimeError("SparseMixerMoE has no experts yet: load the model with cpumoe.models.load_model")
        flat = x.reshape(-1, x.shape[-1])  # [M, H]
        weights, ids = sparsemixer(self.gate(flat), self.jitter_eps)  # router logits [M, E] -> [M, 2] x2
        return self.experts.experts(flat, weights, ids).view(x.shape)

    def extra_repr(self) -> str:
        return f"top_k={TOP_K}, routing=sparsemixer, jitter_eps={self.jitter_eps}"


class PhimoeArchitecture(Architecture):
    model_type = "phimoe"
    hf_name = "Phimoe"
    expert_projections = ("w1", "w3", "w2")
    # microsoft/Phi-3.5-MoE-instruct's config.json, but for rope_scaling's short_factor and long_factor (64 numbers
    # each, not copied here: they only change RoPE's frequencies, not the work), where ones stand in. head_dim is
    # hidden / heads written out, so layer shapes of another hidden size keep the heads the factors fit
    presets = (
        ModelPreset("phi-3.5-moe", "microsoft/Phi-3.5-MoE-instruct", dict(
            num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            vocab_size=32064, intermediate_size=6400, num_local_experts=16, num_experts_per_tok=2, hidden_act="silu",
            router_jitter_noise=0.01, input_jitter_noise=0.01, router_aux_loss_coef=0.0, attention_bias=True,
            lm_head_bias=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
            original_max_position_embeddings=4096, sliding_window=131072, tie_word_embeddings=False,
            rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 64,
                                 long_factor=[1.0] * 64, short_mscale=1.243163121016122,
                                 long_mscale=1.243163121016122, original_max_position_embeddings=4096))),
    )
    # head_dim 16: 8 factors each; long_factor unlike short_factor (transformers never uses it); the conformance
    # prompt (11 tokens) + generation cross original_max_position_embeddings and the 8-token window; a jitter of
    # 0.1 makes logits within 20% of the best candidates, so the weights are softmaxes, not ones
    tiny = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.1, sliding_window=8,
                max_position_embeddings=512, original_max_position_embeddings=16,
                rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                     short_factor=[1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0], long_factor=[8.0] * 8,
                                     short_mscale=1.243163121016122, long_mscale=1.243163121016122,
                                     original_max_position_embeddings=16))

    def config(self, ckpt: CheckpointConfig) -> PhimoeConfig:
        return parse_config(ckpt)

    def layer(self, config: PhimoeConfig, index: int, backend: str) -> nn.Module:
        c = config
        attention = Attention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                              num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                              qk_norm=QKNorm.NONE, norm_eps=c.rms_norm_eps, qkv_bias=c.attention_bias,
                              o_bias=c.attention_bias, sliding_window=c.sliding_window)
        if c.rope_scaling is not None:
            attention.rotary = long_rope(c.head_dim, c.rope_theta, c.rope_scaling)
        moe = SparseMixerMoE(hidden_size=c.hidden_size, num_experts=c.num_local_experts,
                             inter_size=c.intermediate_size, jitter_eps=c.router_jitter_noise, backend=backend)
        return DecoderLayer(index, self_attn=attention, mlp=moe, mlp_name="block_sparse_moe",
                            input_layernorm=nn.LayerNorm(c.hidden_size, eps=c.rms_norm_eps),
                            post_attention_layernorm=nn.LayerNorm(c.hidden_size, eps=c.rms_norm_eps))

    def final_norm(self, config: PhimoeConfig) -> nn.Module:
        return nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def layer_shape_config(self, *, hidden: int, inter: int, experts: int, top_k: int) -> dict:
        if top_k != TOP_K:
            raise ValueError(f"phimoe: sparsemixer routes every token to {TOP_K} experts; no config gives "
                             f"top_k={top_k}")
        return dict(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k)

    def layer_preset(self, preset: ModelPreset):
        from cpumoe.presets import LayerPreset
        c = self.preset_config(preset)
        return LayerPreset(preset.name, hidden=c.hidden_size, inter=c.intermediate_size, experts=c.num_local_experts,
                           top_k=TOP_K, shared_experts=0, activation="silu", scoring="sparsemixer", renormalize=False)


ARCHITECTURE = PhimoeArchitecture()
