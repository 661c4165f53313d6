"""Synthetic checkpoints in the real Hugging Face layout: the config class's own config.json, safetensors shards
named and indexed as on the hub, and tensors with the hub checkpoints' names and the real per-layer shapes,
filled with seeded random numbers. Fewer layers (and a smaller vocabulary) keep the real shapes at a size this
machine holds; `overrides` shrink anything else (tests).

    plan (names, shapes; no memory) -> shards of <= max_shard_bytes -> per shard: generate, save_file, free

Each tensor draws from its own generator, seeded from (seed, tensor name), so the bytes of a tensor do not depend on
the shard plan, and a shard's tensors can be drawn in parallel. The model is never instantiated: peak memory is
about one shard.

On-disk names (what `save_pretrained` writes; transformers fuses the experts when loading, see
transformers/conversion_mapping.py):
    model.embed_tokens.weight [V, H]   model.norm.weight [H]   lm_head.weight [V, H] (no tied embeddings)
    model.layers.{i}.input_layernorm.weight / post_attention_layernorm.weight [H]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, self_attn.{q,k}_norm.weight (Qwen3: [D]; OLMoE: [heads*D])
    Qwen3-MoE, OLMoE: model.layers.{i}.mlp.gate.weight [E, H], mlp.experts.{e}.{gate,up}_proj.weight [I, H],
                      mlp.experts.{e}.down_proj.weight [H, I]
    Mixtral:          model.layers.{i}.block_sparse_moe.gate.weight [E, H],
                      block_sparse_moe.experts.{e}.{w1,w3}.weight [I, H] (gate, up), .w2.weight [H, I] (down)
"""
from __future__ import annotations

import json
import math
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from cpumoe.loader.shards import shard_names, split_into_shards
from cpumoe.presets import get_preset
from cpumoe.synthetic import tokenizer as tok

MAX_SHARD_BYTES = 2 * 1024**3
INIT_STD = 0.02


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """How one model family's config and checkpoint look. The MoE shape (H, I, E, k) comes from cpumoe.presets."""
    config_class: str                # a transformers config class
    config: dict                     # the real model's config.json values not in the layer preset
    experts_field: str               # the config field holding E
    inter_field: str                 # the config field holding one expert's I
    moe: str                         # module holding the router and the experts
    expert_names: tuple[str, str, str]   # gate, up, down projection names
    qk_norm: str                     # "head": [head_dim]; "full": [heads * head_dim]; "": none
    tiny: dict = field(default_factory=dict)   # config overrides for a checkpoint of a few hundred kB


_TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

MODELS: dict[str, ModelSpec] = {
    "qwen3-30b-a3b": ModelSpec(   # Qwen/Qwen3-30B-A3B
        "Qwen3MoeConfig",
        dict(num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
             intermediate_size=6144, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
             tie_word_embeddings=False, max_window_layers=48, use_sliding_window=False),
        experts_field="num_experts", inter_field="moe_intermediate_size", moe="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"), qk_norm="head",
        tiny=dict(_TINY, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2)),
    "olmoe-1b-7b": ModelSpec(     # allenai/OLMoE-1B-7B-0924
        "OlmoeConfig",
        dict(num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, vocab_size=50304,
             max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
             clip_qkv=None),
        experts_field="num_experts", inter_field="intermediate_size", moe="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"), qk_norm="full",
        tiny=dict(_TINY, intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    "mixtral-8x7b": ModelSpec(    # mistralai/Mixtral-8x7B-v0.1
        "MixtralConfig",
        dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
             max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False,
             sliding_window=None),
        experts_field="num_local_experts", inter_field="intermediate_size", moe="block_sparse_moe",
        expert_names=("w1", "w3", "w2"), qk_norm="",
        tiny=dict(_TINY, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
}


def _spec(preset: str) -> ModelSpec:
    if preset not in MODELS:
        raise ValueError(f"no synthetic checkpoint for preset {preset!r}; known: {', '.join(MODELS)}")
    return MODELS[preset]


def tiny_overrides(preset: str) -> dict:
    """Config overrides that make `preset` a checkpoint of a few hundred kB, for tests."""
    return dict(_spec(preset).tiny)


def build_config(preset: str, *, layers: int, vocab: int, dtype: torch.dtype, special_ids: dict[str, int],
                 overrides: dict | None = None):
    """The transformers config of `preset` with `layers` layers and `vocab` rows, then `overrides`."""
    import transformers

    spec, layer = _spec(preset), get_preset(preset)
    values = dict(spec.config, hidden_size=layer.hidden, num_experts_per_tok=layer.top_k,
                  **{spec.experts_field: layer.experts, spec.inter_field: layer.inter})
    if "norm_topk_prob" in getattr(transformers, spec.config_class)().to_dict():
        values["norm_topk_prob"] = layer.renormalize
    rope_theta = values.pop("rope_theta")
    values.update(num_hidden_layers=layers, vocab_size=vocab, **special_ids, **(overrides or {}))
    values.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": rope_theta})
    config = getattr(transformers, spec.config_class)(**values)
    config.architectures = [spec.config_class.removesuffix("Config") + "ForCausalLM"]
    config.dtype = dtype
    return config


@dataclass(frozen=True, slots=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    init: str     # "normal" (std INIT_STD) or "ones" (norm weights)


def plan_tensors(preset: str, config) -> list[TensorPlan]:
    """Every tensor of the checkpoint, in hub order (embedding, layer by layer, final norm, lm_head)."""
    spec = _spec(preset)
    H, V = config.hidden_size, config.vocab_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or H // heads
    E, I = getattr(config, spec.experts_field), getattr(config, spec.inter_field)
    gate, up, down = spec.expert_names

    def layer(i: int) -> Iterator[TensorPlan]:
        p = f"model.layers.{i}."
        yield TensorPlan(p + "input_layernorm.weight", (H,), "ones")
        yield TensorPlan(p + "self_attn.q_proj.weight", (heads * D, H), "normal")
        yield TensorPlan(p + "self_attn.k_proj.weight", (kv_heads * D, H), "normal")
        yield TensorPlan(p + "self_attn.v_proj.weight", (kv_heads * D, H), "normal")
        yield TensorPlan(p + "self_attn.o_proj.weight", (H, heads * D), "normal")
        if spec.qk_norm == "head":
            yield TensorPlan(p + "self_attn.q_norm.weight", (D,), "ones")
            yield TensorPlan(p + "self_attn.k_norm.weight", (D,), "ones")
        elif spec.qk_norm == "full":
            yield TensorPlan(p + "self_attn.q_norm.weight", (heads * D,), "ones")
            yield TensorPlan(p + "self_attn.k_norm.weight", (kv_heads * D,), "ones")
        yield TensorPlan(p + "post_attention_layernorm.weight", (H,), "ones")
        yield TensorPlan(p + f"{spec.moe}.gate.weight", (E, H), "normal")
        for e in range(E):
            q = p + f"{spec.moe}.experts.{e}."
            yield TensorPlan(q + f"{gate}.weight", (I, H), "normal")
            yield TensorPlan(q + f"{up}.weight", (I, H), "normal")
            yield TensorPlan(q + f"{down}.weight", (H, I), "normal")

    plans = [TensorPlan("model.embed_tokens.weight", (V, H), "normal")]
    for i in range(config.num_hidden_layers):
        plans.extend(layer(i))
    plans.append(TensorPlan("model.norm.weight", (H,), "ones"))
    if not config.tie_word_embeddings:
        plans.append(TensorPlan("lm_head.weight", (V, H), "normal"))
    return plans


def _nbytes(plan: TensorPlan, dtype: torch.dtype) -> int:
    return math.prod(plan.shape) * dtype.itemsize


def _generate(plan: TensorPlan, *, seed: int, dtype: torch.dtype) -> torch.Tensor:
    if plan.init == "ones":
        return torch.ones(plan.shape, dtype=dtype)
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{plan.name}".encode()))   # CPU seeds are 32-bit
    return torch.empty(plan.shape, dtype=dtype).normal_(0.0, INIT_STD, generator=generator)


def make_checkpoint(preset: str, out_dir, *, layers: int, vocab: int | None = None, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16, overrides: dict | None = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES,
                    progress: Callable[[int, int, list[str]], None] | None = None) -> Path:
    """Write a synthetic `preset` checkpoint with `layers` layers to `out_dir` and return its path.

    vocab: the config's vocab_size (default: the real model's); the tokenizer is trained to at most that many
    tokens, and embedding rows past the tokenizer are valid ids it never produces. `progress(done, total, files)`
    is called after each shard is written.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    spec = _spec(preset)
    if layers < 1:
        raise ValueError(f"layers must be positive, got {layers}")
    vocab = vocab or (overrides or {}).get("vocab_size") or spec.config["vocab_size"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    max_positions = (overrides or {}).get("max_position_embeddings", spec.config["max_position_embeddings"])
    tokenizer = tok.make_tokenizer(out, vocab, seed=seed, model_max_length=max_positions)
    ids = {f"{role}_token_id": tokenizer.token_to_id(token)
           for role, token in (("bos", tok.BOS), ("eos", tok.EOS), ("pad", tok.PAD))}
    config = build_config(preset, layers=layers, vocab=vocab, dtype=dtype, special_ids=ids,
                          overrides={k: v for k, v in (overrides or {}).items() if k != "vocab_size"})
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)

    shards = split_into_shards(plan_tensors(preset, config), lambda p: _nbytes(p, dtype), max_shard_bytes)
    names = shard_names(len(shards))
    weight_map, total_size, total_params = {}, 0, 0
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        for done, (plans, name) in enumerate(zip(shards, names), start=1):
            tensors = dict(zip((p.name for p in plans),
                               pool.map(lambda p: _generate(p, seed=seed, dtype=dtype), plans)))
            save_file(tensors, str(out / name), metadata={"format": "pt"})
            for key, t in tensors.items():
                weight_map[key] = name
                total_size += t.nbytes
                total_params += t.numel()
            del tensors
            if progress:
                progress(done, len(shards), names[:done])
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size, "total_parameters": total_params},
                 "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
