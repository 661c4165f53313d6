"""Gemma 4 with MoE blocks (google/gemma-4-26B-A4B-it), as transformers' Gemma4ForCausalLM. model_type
"gemma4_text" is the text model; "gemma4" (Gemma4ForConditionalGeneration, the published checkpoints) has it under
text_config and model.language_model.*: that text decoder is loaded, its vision and audio towers skipped.

    input_ids -> embed * sqrt(H) -> N x layer (gemma4_layer.py) -> norm -> lm_head -> tanh soft-capping -> logits

Where it departs from the shared decoder:
- each layer runs a dense GELU MLP and the routed experts side by side, each with norms of its own, and scales
  its output by a learned layer_scalar; the router reads the layer's input, RMS-normed without a weight, times a
  learned scale and H^-0.5, and multiplies the renormalized top-k softmax weights by a learned per-expert scale;
- attention: q and k RMS-normed per head with weights, v without; scale 1; layer_types gives each layer sliding
  (the last sliding_window keys) or full attention. Full layers have their own head_dim (global_head_dim) and, with
  attention_k_eq_v, their own KV heads (num_global_key_value_heads) and no v_proj: the values are the keys'
  projection (v-normed, not rotated). config.json says the per-layer shapes as global_head_dim /
  num_global_key_value_heads, or as per_layer_config (what transformers writes);
- RoPE per layer type (rope_parameters["sliding_attention"], ["full_attention"]): "default", or "proportional",
  which rotates only the first partial_rotary_factor of each half of the head (frequencies over the whole
  head_dim) and leaves the rest unrotated;
- every RMSNorm multiplies its weight in float32 before the cast; the embedding is scaled by sqrt(H) (rounded to
  the model dtype); the logits are soft-capped: cap * tanh(logits / cap) (final_logit_softcapping).
Not supported (CheckpointError): per-layer input embeddings (hidden_size_per_layer_input, the small Gemma 4
models), KV sharing across layers (num_kv_shared_layers), bidirectional attention over all tokens
(use_bidirectional_attention "all"), dense models (enable_moe_block false); use_double_wide_mlp widens only
KV-sharing layers' MLPs, so it changes nothing here. Images, video and audio are not inputs: text only ("vision"
bidirectional attention changes nothing for text tokens).
Config: https://huggingface.co/docs/transformers/model_doc/gemma4
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from cpumoe.attention import KVCacheLayout
from cpumoe.loader import Checkpoint, CheckpointConfig, CheckpointError
from cpumoe.loader.checkpoint import CheckpointView
from cpumoe.logs import logger
from cpumoe.models.architecture import Architecture, ModelPreset
from cpumoe.models.blocks import MoEBlock
from cpumoe.models.gemma4_layer import Gemma4DecoderLayer, GemmaRMSNorm, ScaledEmbedding

if TYPE_CHECKING:
    from cpumoe.presets import LayerPreset

LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_TYPES = ("default", "proportional")
# config.json's hidden_activation -> FusedMoE's activation (transformers' ACT2FN: tanh-approximated or exact GELU)
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# transformers' defaults (Gemma4TextConfig) where config.json leaves a value out
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_PER_LAYER_INPUT = 256
SLIDING_WINDOW_PATTERN = 6  # without layer_types: 5 sliding layers, then a full one
PER_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")
TEXT_PREFIX = "model.language_model."  # the text decoder's tensors in a gemma4 (multimodal) checkpoint


@dataclass(frozen=True, slots=True)
class RopeSpec:
    kind: str  # "default" or "proportional"
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(slots=True)
class Gemma4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int  # the dense MLP of every layer
    num_attention_heads: int
    layer_types: list[str]
    head_dims: list[int]  # per layer
    kv_heads: list[int]  # per layer
    attention_k_eq_v: bool
    attention_bias: bool
    sliding_window: int | None
    rope: dict[str, RopeSpec]  # per layer type
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    activation: str  # FusedMoE's name of the GELU
    final_logit_softcapping: float | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    kv_cache_layout: KVCacheLayout  # the same for every layer; see Gemma4Attention
    kv_cache_channels: int  # K (and V) channels a token keeps per layer: kv_cache_layout's heads x dims


def text_config(ckpt: CheckpointConfig) -> CheckpointConfig:
    """The text model's config: config.json itself (gemma4_text), or its text_config (gemma4) with the top level's
    dtype and tie_word_embeddings, which describe the whole checkpoint."""
    if ckpt.model_type != "gemma4":
        return ckpt
    text = ckpt.config_get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{ckpt.path}: text_config must be an object, got {type(text).__name__}")
    top = {key: ckpt.config[key] for key in ("dtype", "torch_dtype", "tie_word_embeddings")
           if key in ckpt.config}
    return CheckpointConfig(ckpt.path, {**text, **top, "model_type": "gemma4_text"})


def parse_config(ckpt: CheckpointConfig) -> Gemma4Config:
    where = f"{ckpt.path}: {'text_config.' if ckpt.model_type == 'gemma4' else ''}"
    ckpt = text_config(ckpt)
    get = ckpt.config_get

    def refuse(field: str, value, why: str):
        raise CheckpointError(f"{where}{field}={value!r}: {why} is not supported")

    if ple := get("hidden_size_per_layer_input", default=DEFAULT_PER_LAYER_INPUT):
        refuse("hidden_size_per_layer_input", ple, "per-layer input embeddings (PLE)")
    if shared := get("num_kv_shared_layers", default=0):
        refuse("num_kv_shared_layers", shared, "sharing KV states across layers")
    if (bidirectional := get("use_bidirectional_attention", default=None)) not in (None, "vision"):
        refuse("use_bidirectional_attention", bidirectional, "bidirectional attention over text tokens")
    if not (moe := get("enable_moe_block", default=False)):
        refuse("enable_moe_block", moe, "a dense Gemma 4 (no MoE block)")
    if (act := get("hidden_activation", default="gelu_pytorch_tanh")) not in ACTIVATIONS:
        refuse("hidden_activation", act, f"an activation other than {', '.join(ACTIVATIONS)}")
    cap = get("final_logit_softcapping", default=None)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
        refuse("final_logit_softcapping", cap, "a cap that is not a positive number")

    layers, heads = get("num_hidden_layers"), get("num_attention_heads")
    layer_types = get("layer_types", default=None) or [
        "sliding_attention" if (i + 1) % SLIDING_WINDOW_PATTERN else "full_attention" for i in range(layers)]
    if not isinstance(layer_types, list) or len(layer_types) != layers or not set(layer_types) <= set(LAYER_TYPES):
        raise CheckpointError(f"{where}layer_types must give one of {LAYER_TYPES} per layer ({layers}), "
                              f"got {layer_types!r}")
    layer_types = [*layer_types[:-1], "full_attention"]  # transformers makes the last layer full, whatever it says
    window = get("sliding_window", default=512)
    if "sliding_attention" in layer_types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        refuse("sliding_window", window, "a window that is not a positive integer")
    head_dims, kv_heads = _per_layer_shapes(get, where, layer_types)
    for i, (d, nkv) in enumerate(zip(head_dims, kv_heads)):
        if nkv < 1 or heads % nkv or d < 2 or d % 2:
            raise CheckpointError(f"{where}layer {i} has {nkv} KV heads of {d} channels for {heads} query heads: "
                                  "the KV heads must divide the query heads, and RoPE needs an even head_dim")
    channels = _cache_channels(where, heads, head_dims, kv_heads)
    widest = max(range(layers), key=lambda i: head_dims[i] * kv_heads[i])
    d = head_dims[widest]
    return Gemma4Config(
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_hidden_layers=layers,
        intermediate_size=get("intermediate_size"), num_attention_heads=heads, layer_types=layer_types,
        head_dims=head_dims, kv_heads=kv_heads, attention_k_eq_v=bool(get("attention_k_eq_v", default=False)),
        attention_bias=bool(get("attention_bias", default=False)),
        sliding_window=window if "sliding_attention" in layer_types else None,
        rope=_rope(get, where, set(layer_types)), num_experts=get("num_experts"),
        top_k_experts=_top_k(get, where), moe_intermediate_size=get("moe_intermediate_size"),
        activation=ACTIVATIONS[act], final_logit_softcapping=None if cap is None else float(cap),
        rms_norm_eps=get("rms_norm_eps", default=1e-6),
        tie_word_embeddings=bool(get("tie_word_embeddings", default=True)),
        kv_cache_layout=KVCacheLayout(num_kv_heads=channels // d, k_dim=d, v_dim=d), kv_cache_channels=channels)


def _top_k(get, where: str) -> int:
    top_k, experts, inter = get("top_k_experts"), get("num_experts"), get("moe_intermediate_size")
    if not isinstance(top_k, int) or not isinstance(experts, int) or not 1 <= top_k <= experts:
        raise CheckpointError(f"{where}top_k_experts={top_k!r} must be in [1, num_experts={experts!r}]")
    if not isinstance(inter, int) or inter < 1:
        raise CheckpointError(f"{where}moe_intermediate_size={inter!r} must be a positive integer")
    return top_k


def _per_layer_shapes(get, where: str, layer_types: list[str]) -> tuple[list[int], list[int]]:
    """Each layer's head_dim and KV heads, as transformers' Gemma4TextConfig sets them: per_layer_config's
    overrides when config.json has one; else full-attention layers take global_head_dim (512 unless given) and,
    with attention_k_eq_v, num_global_key_value_heads (when given)."""
    head_dim, kv = get("head_dim", default=256), get("num_key_value_heads", default=4)
    head_dims, kv_heads = [head_dim] * len(layer_types), [kv] * len(layer_types)
    per_layer = get("per_layer_config", default=None)
    if per_layer is None:
        full_kv = get("num_global_key_value_heads", default=None) if get("attention_k_eq_v", default=False) else None
        for i, kind in enumerate(layer_types):
            if kind == "full_attention":
                head_dims[i] = get("global_head_dim", default=DEFAULT_GLOBAL_HEAD_DIM)
                kv_heads[i] = kv if full_kv is None else full_kv
        return head_dims, kv_heads
    if not isinstance(per_layer, dict):
        raise CheckpointError(f"{where}per_layer_config must be an object of layer -> overrides, got {per_layer!r}")
    for key, overrides in per_layer.items():
        index = int(key) if str(key).isdigit() else -1
        if not 0 <= index < len(layer_types) or not isinstance(overrides, dict):
            raise CheckpointError(f"{where}per_layer_config[{key!r}] must be a layer index < {len(layer_types)} "
                                  f"with an object of overrides, got {overrides!r}")
        unknown = sorted(set(overrides) - set(PER_LAYER_OVERRIDES))
        if unknown:
            raise CheckpointError(f"{where}per_layer_config[{key!r}] overrides {unknown}: only "
                                  f"{', '.join(PER_LAYER_OVERRIDES)} may differ between layers")
        head_dims[index] = overrides.get("head_dim", head_dim)
        kv_heads[index] = overrides.get("num_key_value_heads", kv)
    return head_dims, kv_heads


def _cache_channels(where: str, heads: int, head_dims: list[int], kv_heads: list[int]) -> int:
    """K channels a token keeps per layer in the paged cache (one layout for every layer): the widest layer's
    nkv x d. A narrower layer views them as heads of its d and repeats its KV heads to fill them, which needs its
    d to divide them into a count of heads that is a multiple of its KV heads and divides the query heads."""
    channels = max(d * nkv for d, nkv in zip(head_dims, kv_heads))
    for i, (d, nkv) in enumerate(zip(head_dims, kv_heads)):
        view = channels // d
        if channels % d or view % nkv or heads % view:
            raise CheckpointError(f"{where}layer {i}'s {nkv} KV heads of {d} channels do not fit the cache's "
                                  f"{channels} channels per token as a whole number of heads dividing the "
                                  f"{heads} query heads")
    return channels


def _rope(get, where: str, layer_types: set[str]) -> dict[str, RopeSpec]:
    """rope_parameters per layer type (transformers' default when config.json has none)."""
    params = get("rope_parameters", default=None) or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
    specs = {}
    for kind in sorted(layer_types):
        rope = params.get(kind) if isinstance(params, dict) else None
        if not isinstance(rope, dict):
            raise CheckpointError(f"{where}rope_parameters must hold a dict for {kind!r} layers, got {params!r}")
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise CheckpointError(f"{where}rope_parameters[{kind!r}] rope_type {rope_type!r} is not supported; "
                                  f"supported: {', '.join(ROPE_TYPES)}")
        if not isinstance(rope.get("rope_theta"), (int, float)):
            raise CheckpointError(f"{where}rope_parameters[{kind!r}] needs a rope_theta, got {rope!r}")
        partial, factor = (1.0 if rope.get(key) is None else rope[key] for key in ("partial_rotary_factor", "factor"))
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (partial, factor)):
            raise CheckpointError(f"{where}rope_parameters[{kind!r}]: partial_rotary_factor and factor must be "
                                  f"numbers, got {rope!r}")
        if rope_type == "default" and (partial != 1.0 or factor != 1.0):
            raise CheckpointError(f"{where}rope_parameters[{kind!r}]: partial_rotary_factor {partial} / factor "
                                  f"{factor} with rope_type 'default' is not supported (transformers ignores them)")
        if not 0 < partial <= 1 or not factor > 0:
            raise CheckpointError(f"{where}rope_parameters[{kind!r}]: partial_rotary_factor {partial} must be in "
                                  f"(0, 1] and factor {factor} positive")
        specs[kind] = RopeSpec(rope_type, float(rope["rope_theta"]), float(partial), float(factor))
    return specs


def language_model(ckpt: Checkpoint) -> CheckpointView:
    """The text decoder inside a gemma4 checkpoint as a gemma4_text one: config.json's text_config (text_config())
    and the tensors model.language_model.X under the names model.X (lm_head.weight as it is). The vision and audio
    towers and their projections are not in it."""
    if ckpt.config_get("quantization_config", default=None):
        raise CheckpointError(f"{ckpt.path}: quantization_config: quantized multimodal gemma4 checkpoints are "
                              "not supported; a gemma4_text checkpoint of the text decoder is")
    names = {("model." + name.removeprefix(TEXT_PREFIX)) if name.startswith(TEXT_PREFIX) else name: name
             for name in ckpt.keys() if name.startswith(TEXT_PREFIX) or name == "lm_head.weight"}
    return CheckpointView(ckpt, text_config(ckpt).config, names)


class Gemma4Architecture(Architecture):
    model_type = "gemma4_text"
    hf_name = "Gemma4Text"
    also_reads = ("gemma4",)
    # the layer types are transformers' default: 5 sliding layers, then a full one, the last layer full
    presets = (
        ModelPreset("gemma-4-26b-a4b", "google/gemma-4-26B-A4B-it", dict(
            num_hidden_layers=30, vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_attention_heads=16,
            num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
            attention_k_eq_v=True, enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
            hidden_activation="gelu_pytorch_tanh", sliding_window=1024, final_logit_softcapping=30.0,
            rms_norm_eps=1e-6, max_position_embeddings=262144, attention_bias=False, tie_word_embeddings=True,
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=262144, num_kv_shared_layers=0,
            use_double_wide_mlp=False, use_bidirectional_attention="vision",
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": 1000000.0}})),
    )
    # 2 sliding layers (window 4, shorter than the prompt), then a full one with its own head_dim and one KV head,
    # k = v, proportional RoPE over 4 of its 16 channel pairs; its KV heads fill the cache's twice (see
    # Gemma4Attention); GQA everywhere; attention biases on
    tiny = dict(hidden_size=64, intermediate_size=48, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                global_head_dim=32, num_global_key_value_heads=1, moe_intermediate_size=32, num_experts=8,
                top_k_experts=2, sliding_window=4, attention_bias=True, max_position_embeddings=512,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"])

    @property
    def hf_model_class(self) -> str:
        return "Gemma4ForCausalLM"

    def open_checkpoint(self, ckpt: Checkpoint) -> Checkpoint:
        if ckpt.model_type != "gemma4":
            return ckpt
        text = language_model(ckpt)
        skipped = sorted({key.split(".")[1] if key.startswith("model.") else key.split(".")[0]
                          for key in ckpt.keys() if not key.startswith(TEXT_PREFIX) and key != "lm_head.weight"})
        logger.info("%s: a multimodal gemma4 checkpoint: its text decoder is loaded, %s skipped (text is the only "
                    "input)", ckpt.path, ", ".join(skipped) or "nothing else")
        return text

    def config(self, ckpt: CheckpointConfig) -> Gemma4Config:
        return parse_config(ckpt)

    def layer(self, config: Gemma4Config, index: int, backend: str) -> nn.Module:
        return Gemma4DecoderLayer(config, index, backend)

    def embedding(self, config: Gemma4Config) -> nn.Module:
        return ScaledEmbedding(config.vocab_size, config.hidden_size)

    def final_norm(self, config: Gemma4Config) -> nn.Module:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def final_logits(self, config: Gemma4Config, logits: torch.Tensor) -> torch.Tensor:
        cap = config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def kv_cache_layout(self, config: Gemma4Config) -> KVCacheLayout:
        return config.kv_cache_layout

    def expert_tensors(self, config: Gemma4Config, block: MoEBlock) -> list[tuple[str, tuple[int, ...]]]:
        """The fused layout of the published checkpoints and save_pretrained."""
        E, I, H = block.num_experts, block.inter_size, block.hidden_size
        return [("experts.gate_up_proj", (E, 2 * I, H)), ("experts.down_proj", (E, H, I))]

    def experts_from_checkpoint(self, config: Gemma4Config, ckpt: Checkpoint, prefix: str, block: MoEBlock,
                                dtype: torch.dtype) -> dict | None:
        """experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I] (float), read one expert at a time (the
        loader's fused path would hold a whole layer's); None where they are not so (per expert, quantized)."""
        tensors = self.expert_tensors(config, block)
        names = {key: f"{prefix}.{tensor}" for key, (tensor, _) in zip(("w13", "w2"), tensors)}
        if not all(name in ckpt and ckpt.dtype(name).is_floating_point for name in names.values()):
            return None
        shapes = block.expert_shapes
        for key, name in names.items():
            if tuple(ckpt.shape(name)) != shapes[key]:
                raise CheckpointError(f"tensor {name!r} in {ckpt.path} has shape {list(ckpt.shape(name))}, "
                                      f"expected {list(shapes[key])}")

        def read_expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            return tuple(ckpt.read(names[key], index=e).to(dtype) for key in ("w13", "w2"))  # [2I, H], [H, I]

        return {key: torch.empty(shapes[key], dtype=dtype, device="meta") for key in ("w13", "w2")} | dict(
            expert_reader=read_expert)

    def layer_shape_config(self, *, hidden: int, inter: int, experts: int, top_k: int) -> dict:
        return dict(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, top_k_experts=top_k)

    def layer_preset(self, preset: ModelPreset) -> LayerPreset:
        """The routed experts, and the dense MLP beside them as a shared expert (ungated, on every token)."""
        from cpumoe.presets import LayerPreset
        c = self.preset_config(preset)
        return LayerPreset(preset.name, hidden=c.hidden_size, inter=c.moe_intermediate_size, experts=c.num_experts,
                           top_k=c.top_k_experts, shared_experts=1, activation=c.activation, scoring="softmax",
                           renormalize=True, shared_inter=c.intermediate_size)


ARCHITECTURE = Gemma4Architecture()
