"""gpt-oss (model_type "gpt_oss": openai/gpt-oss-20b, gpt-oss-120b), as transformers' GptOssForCausalLM.

    input_ids -> embed -> N x [x += attn(norm(x)); x += moe(norm(x))] -> norm -> lm_head -> logits

Where it departs from the Llama-style decoder (its layers are the shared DecoderLayer over these modules):
- attention: q/k/v/o biases, attention sinks (a learned logit per head that joins the softmax denominator), and
  layer l sees only its last `sliding_window` keys when layer_types[l] is "sliding_attention" (the full context
  when "full_attention"); head_dim from the config (64), scale head_dim^-0.5; yarn RoPE (rope.py);
- RMSNorm multiplies by its weight in float32, then casts (Llama's casts, then multiplies);
- every layer is MoE: the router `router` is a linear with a bias; top-k of its logits, softmax over those k (the
  same as softmax, top-k, renormalize); experts with biases and the clamped swigluoai activation (alpha 1.702,
  limit 7; cpumoe.reference.activate).

Experts on disk, two layouts, both read one expert at a time into FusedMoE's w13 [2I, H] (gate rows, then up rows)
and w2 [H, I], so loading peaks near the packed size:
- transformers' (save_pretrained): mlp.experts.gate_up_proj [E, H, 2I] with gate = [..., ::2], up = [..., 1::2]
  (interleaved), gate_up_proj_bias [E, 2I] (interleaved too), down_proj [E, I, H], down_proj_bias [E, H];
- MXFP4 (the published checkpoints; config.json quantization_config.quant_method "mxfp4"): gate_up_proj_blocks /
  _scales for W [2I, H] (out x in, rows gate/up interleaved) and down_proj_blocks / _scales for W [H, I],
  dequantized to the model dtype (loader/mxfp4.py); the biases as above.
Config: https://huggingface.co/docs/transformers/model_doc/gpt_oss
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from cpumoe.layer import FusedMoE
from cpumoe.loader import Checkpoint, CheckpointConfig, CheckpointError, mxfp4
from cpumoe.loader.quantized import QuantizedCheckpoint
from cpumoe.models.architecture import Architecture, DecoderLayer, ModelPreset
from cpumoe.models.blocks import Attention, MoEBlock, QKNorm, RMSNorm
from cpumoe.models.rope import rope_from_config
from cpumoe.quant import QuantizedWeight
from cpumoe.reference import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(slots=True)
class GptOssConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # each expert
    num_local_experts: int
    num_experts_per_tok: int
    sliding_window: int | None
    layer_types: list[str] = field(default_factory=list)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: dict | None = None  # rope.rope_from_config's dict; None: default RoPE
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    quantization: str | None = None  # "mxfp4": the experts are MXFP4 blocks and scales on disk

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_checkpoint(cls, ckpt: CheckpointConfig) -> "GptOssConfig":
        get = ckpt.config_get
        layers = get("num_hidden_layers")
        # transformers' default: sliding, full, sliding, ...
        layer_types = get("layer_types", default=None) or [LAYER_TYPES[i % 2] for i in range(layers)]
        if len(layer_types) != layers or not set(layer_types) <= set(LAYER_TYPES):
            raise CheckpointError(f"{ckpt.path}: layer_types must give one of {LAYER_TYPES} per layer ({layers}), "
                                  f"got {layer_types}")
        window = get("sliding_window", default=None)
        if "sliding_attention" in layer_types and not window:
            raise CheckpointError(f"{ckpt.path}: layer_types has sliding_attention layers but sliding_window is "
                                  f"{window!r}")
        for key, value in (("swiglu_alpha", SWIGLUOAI_ALPHA), ("swiglu_limit", SWIGLUOAI_LIMIT)):
            if get(key, default=value) != value:
                raise CheckpointError(f"{ckpt.path}: {key}={get(key)} is not supported (the swigluoai kernels use "
                                      f"{value})")
        try:
            rope_theta, rope_scaling = rope_from_config(ckpt.config)
        except ValueError as e:
            raise CheckpointError(f"{ckpt.path}: {e}") from None
        heads = get("num_attention_heads")
        return cls(
            vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=get("num_key_value_heads", default=heads),
            head_dim=get("head_dim", default=None) or get("hidden_size") // heads,
            intermediate_size=get("intermediate_size"), num_local_experts=get("num_local_experts", "num_experts"),
            num_experts_per_tok=get("num_experts_per_tok", "experts_per_token"), sliding_window=window,
            layer_types=list(layer_types), rms_norm_eps=get("rms_norm_eps", default=1e-5), rope_theta=rope_theta,
            rope_scaling=rope_scaling, attention_bias=bool(get("attention_bias", default=True)),
            tie_word_embeddings=get("tie_word_embeddings", default=False),
            quantization=mxfp4.check_quantization(ckpt),
        )


class GptOssRMSNorm(RMSNorm):
    weight_in_float = True  # the weight in float32, then the cast (transformers' order)


class GptOssMoE(MoEBlock):
    """MoEBlock whose router `router` has a bias ([E, H] weight, [E] bias; transformers' mlp.router) and whose experts
    have biases and the swigluoai activation. Routing: softmax over the top-k logits == softmax, top-k, renormalize."""

    def __init__(self, *, hidden_size: int, num_experts: int, inter_size: int, top_k: int, backend: str = "auto"):
        super().__init__(hidden_size=hidden_size, num_experts=num_experts, inter_size=inter_size, top_k=top_k,
                         renormalize=True, backend=backend)
        del self.gate  # the router is named `router` here, and has a bias
        self.router = nn.Linear(hidden_size, num_experts, bias=True)

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor, expert_reader=None, dtype=None, *,
                     w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> None:
        """As MoEBlock's, plus w13_bias [E, 2I] (gate then up, like w13's rows) and w2_bias [E, H]."""
        self.experts = FusedMoE(w13, w2, top_k=self.top_k, activation="swigluoai", renormalize=True,
                                w13_bias=w13_bias, w2_bias=w2_bias, backend=self.backend, expert_reader=expert_reader,
                                dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H]
        if self.experts is None:
            raise RuntimeError("GptOssMoE has no experts yet: load the model with cpumoe.models.load_model")
        flat = x.reshape(-1, x.shape[-1])  # [M, H]
        return self.experts(flat, self.router(flat)).view(x.shape)  # router logits [M, E]


class GptOssArchitecture(Architecture):
    """gpt-oss's layers are the shared DecoderLayer over its own modules; its experts are read through
    `experts_from_checkpoint` (the fused layouts above), not per-expert tensors."""
    model_type = "gpt_oss"
    hf_name = "GptOss"
    presets = tuple(ModelPreset(name, hub_id, dict(
        num_hidden_layers=layers, hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        vocab_size=201088, intermediate_size=2880, num_local_experts=experts, num_experts_per_tok=4,
        sliding_window=128, layer_types=[LAYER_TYPES[i % 2] for i in range(layers)], rms_norm_eps=1e-5,
        max_position_embeddings=131072, attention_bias=True, tie_word_embeddings=False, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
            original_max_position_embeddings=4096, truncate=False)))
        for name, hub_id, layers, experts in (("gpt-oss-20b", "openai/gpt-oss-20b", 24, 32),
                                              ("gpt-oss-120b", "openai/gpt-oss-120b", 36, 128)))
    tiny = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512)

    def config(self, ckpt: CheckpointConfig) -> GptOssConfig:
        return GptOssConfig.from_checkpoint(ckpt)

    def layer(self, config: GptOssConfig, index: int, backend: str) -> nn.Module:
        c = config
        attention = Attention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                              num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                              rope_scaling=c.rope_scaling, qk_norm=QKNorm.NONE, norm_eps=c.rms_norm_eps,
                              qkv_bias=c.attention_bias, o_bias=c.attention_bias, sinks=True,
                              sliding_window=c.window(index))
        moe = GptOssMoE(hidden_size=c.hidden_size, num_experts=c.num_local_experts, inter_size=c.intermediate_size,
                        top_k=c.num_experts_per_tok, backend=backend)
        return DecoderLayer(index, self_attn=attention, mlp=moe,
                            input_layernorm=GptOssRMSNorm(c.hidden_size, c.rms_norm_eps),
                            post_attention_layernorm=GptOssRMSNorm(c.hidden_size, c.rms_norm_eps))

    def final_norm(self, config: GptOssConfig) -> nn.Module:
        return GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)

    def expert_tensors(self, config: GptOssConfig, block: MoEBlock) -> list[tuple[str, tuple[int, ...]]]:
        """transformers' fused layout, biases included (what save_pretrained writes for gpt-oss)."""
        E, I, H = block.num_experts, block.inter_size, block.hidden_size
        return [("experts.gate_up_proj", (E, H, 2 * I)), ("experts.gate_up_proj_bias", (E, 2 * I)),
                ("experts.down_proj", (E, I, H)), ("experts.down_proj_bias", (E, H))]

    def layer_shape_config(self, *, hidden: int, inter: int, experts: int, top_k: int) -> dict:
        return dict(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k)

    def layer_preset(self, preset: ModelPreset):
        from cpumoe.presets import LayerPreset
        c = self.preset_config(preset)
        return LayerPreset(preset.name, hidden=c.hidden_size, inter=c.intermediate_size, experts=c.num_local_experts,
                           top_k=c.num_experts_per_tok, shared_experts=0, activation="swigluoai", scoring="softmax",
                           renormalize=True, bias=True)

    def experts_from_checkpoint(self, config: GptOssConfig, ckpt: Checkpoint, prefix: str, block: GptOssMoE,
                                dtype: torch.dtype) -> dict:
        """GptOssMoE.load_experts' arguments for the block at `prefix` (e.g. "model.layers.3.mlp"): meta w13 / w2, an
        expert_reader that reads, dequantizes and reorders one expert, and the biases (small: read whole)."""
        E, inter, hidden = block.num_experts, block.inter_size, block.hidden_size
        name = f"{prefix}.experts"
        w13_bias = _deinterleave(_read(ckpt, f"{name}.gate_up_proj_bias", (E, 2 * inter)).to(dtype), dim=1)
        w2_bias = _read(ckpt, f"{name}.down_proj_bias", (E, hidden)).to(dtype)
        if config.quantization == mxfp4.QUANT_METHOD:  # kept MXFP4: the kernels run it natively
            quantized = QuantizedCheckpoint(ckpt)
            for proj, (rows, cols) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
                _check_shape(ckpt, f"{name}.{proj}_blocks", (E, rows, cols // mxfp4.BLOCK, 16))

            def read_quantized(e: int) -> tuple[QuantizedWeight, QuantizedWeight]:
                gate_up = quantized.expert(name, "gate_up_proj", e)  # [2I, H], gate and up rows interleaved
                down = quantized.expert(name, "down_proj", e)  # [H, I]
                if gate_up.shape != (2 * inter, hidden) or down.shape != (hidden, inter):
                    raise CheckpointError(f"{name} expert {e}: MXFP4 gate_up_proj {list(gate_up.shape)} and down_proj "
                                          f"{list(down.shape)}, expected {[2 * inter, hidden]} and {[hidden, inter]}")
                return _deinterleave_rows(gate_up), down

            first13, first2 = read_quantized(0)
            return dict(w13=first13.meta_stack(E), w2=first2.meta_stack(E), expert_reader=read_quantized,
                        w13_bias=w13_bias, w2_bias=w2_bias, dtype=dtype)
        else:
            _check_shape(ckpt, f"{name}.gate_up_proj", (E, hidden, 2 * inter))
            _check_shape(ckpt, f"{name}.down_proj", (E, inter, hidden))

            def read_expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
                gate_up = ckpt.read(f"{name}.gate_up_proj", index=e).to(dtype)  # [H, 2I]
                down = ckpt.read(f"{name}.down_proj", index=e).to(dtype)  # [I, H]
                return _deinterleave(gate_up.T, dim=0), down.T.contiguous()  # [2I, H], [H, I]
        return dict(w13=torch.empty(E, 2 * inter, hidden, dtype=dtype, device="meta"),
                    w2=torch.empty(E, hidden, inter, dtype=dtype, device="meta"),
                    expert_reader=read_expert, w13_bias=w13_bias, w2_bias=w2_bias)


def _deinterleave_rows(w: QuantizedWeight) -> QuantizedWeight:
    """A quantized [2I, K] with gate and up rows interleaved -> gate rows, then up rows (codes and scales alike)."""
    return QuantizedWeight(w.format, _deinterleave(w.qweight, 0), _deinterleave(w.scales, 0),
                           None if w.zeros is None else _deinterleave(w.zeros, 0), w.group_size)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gate and up interleaved along `dim` (gate at even indices, transformers' layout) -> gate half, then up half."""
    lead = (slice(None),) * dim
    return torch.cat((t[lead + (slice(0, None, 2),)], t[lead + (slice(1, None, 2),)]), dim=dim).contiguous()


def _check_shape(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> None:
    if name not in ckpt:
        raise CheckpointError(f"tensor {name!r} not found in checkpoint {ckpt.path}")
    if tuple(ckpt.shape(name)) != shape:
        raise CheckpointError(f"tensor {name!r} in {ckpt.path} has shape {list(ckpt.shape(name))}, "
                              f"expected {list(shape)}")


def _read(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    _check_shape(ckpt, name, shape)
    return ckpt.read(name)


ARCHITECTURE = GptOssArchitecture()
