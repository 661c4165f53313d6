"""Synthetic checkpoints in the real Hugging Face layout: the config class's own config.json, safetensors shards
named and indexed as on the hub, and tensors with the hub checkpoints' names and the real per-layer shapes,
filled with seeded random numbers. Fewer layers (and a smaller vocabulary) keep the real shapes at a size this
machine holds; `overrides` shrink anything else (tests).

    preset (cpumoe.models: an architecture's real config.json values) -> transformers config
    -> plan: names and shapes from cpumoe's own model of that config, built on the meta device (every parameter
       loads from the tensor of its name), and the experts as the architecture stores them (expert_tensors)
    -> shards of <= max_shard_bytes -> per shard: generate, save_file, free

Each tensor draws from its own generator, seeded from (seed, tensor name), so the bytes of a tensor do not depend on
the shard plan, and a shard's tensors can be drawn in parallel. No weights are held beyond one shard.
"""
from __future__ import annotations

import json
import math
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from cpumoe.loader import CheckpointConfig
from cpumoe.loader.shards import shard_names, split_into_shards
from cpumoe.synthetic import tokenizer as tok

MAX_SHARD_BYTES = 2 * 1024**3
INIT_STD = 0.02


def _preset(name: str):
    from cpumoe.models import model_presets
    presets = model_presets()
    if name not in presets:
        raise ValueError(f"no synthetic checkpoint for preset {name!r}; known: {', '.join(presets)}")
    return presets[name]


def preset_names() -> list[str]:
    """The presets make-model can write: every real model of every architecture."""
    from cpumoe.models import model_presets
    return list(model_presets())


def tiny_overrides(preset: str) -> dict:
    """Config overrides that make `preset` a checkpoint of a few hundred kB, for tests (its architecture's tiny)."""
    arch, _ = _preset(preset)
    return dict(arch.tiny)


def layer_shape_overrides(preset: str, *, hidden: int, inter: int, experts: int, top_k: int) -> dict:
    """Config overrides that give `preset`'s MoE layers this shape."""
    arch, _ = _preset(preset)
    return arch.layer_shape_config(hidden=hidden, inter=inter, experts=experts, top_k=top_k)


def preset_config(preset: str) -> dict:
    """The real model's config.json values."""
    return dict(_preset(preset)[1].config)


def build_config(preset: str, *, layers: int, vocab: int, dtype: torch.dtype, special_ids: dict[str, int],
                 overrides: dict | None = None):
    """The transformers config of `preset` with `layers` layers and `vocab` rows, then `overrides`."""
    import transformers

    arch, model = _preset(preset)
    values = dict(model.config)
    values.update(num_hidden_layers=layers, vocab_size=vocab, **special_ids, **(overrides or {}))
    if "layer_types" in values and len(values["layer_types"]) != layers:  # one per layer, in the model's cycle
        cycle = values["layer_types"]
        values["layer_types"] = [cycle[i % len(cycle)] for i in range(layers)]
    if "rope_theta" in values and "rope_parameters" not in values:  # transformers 5 keeps it there
        values["rope_parameters"] = {"rope_type": "default", "rope_theta": values.pop("rope_theta")}
    config = getattr(transformers, arch.hf_config_class)(**values)
    config.architectures = [arch.hf_model_class]
    config.dtype = dtype
    return config


@dataclass(frozen=True, slots=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    init: str     # "normal" (std INIT_STD), "ones" (norms, scales) or "zeros" (biases)


def plan_tensors(preset: str, config) -> list[TensorPlan]:
    """Every tensor of the checkpoint: cpumoe's model of `config` names them (embedding, layer by layer with each
    MoE block's experts after its other tensors, final norm, lm_head)."""
    from cpumoe.models import CausalLM
    from cpumoe.models.blocks import MoEBlock

    arch, _ = _preset(preset)
    values = {k: v for k, v in config.to_dict().items() if v is not None or k == "sliding_window"}
    parsed = arch.config(CheckpointConfig(preset, values))
    with torch.device("meta"):
        model = CausalLM(arch, parsed)
    # each block's experts follow its last parameter (the router, or the shared expert), as the hub orders them
    after = {f"{prefix}.{list(dict(block.named_parameters()))[-1]}": (prefix, block)
             for prefix, block in model.named_modules() if isinstance(block, MoEBlock)}
    plans: list[TensorPlan] = []
    for name, param in model.named_parameters():
        plans.append(TensorPlan(name, tuple(param.shape), _init_of(name, param.dim())))
        if name in after:
            prefix, block = after[name]
            plans.extend(TensorPlan(f"{prefix}.{t}", shape, _init_of(t, len(shape)))
                         for t, shape in arch.expert_tensors(parsed, block))
    return plans


def _init_of(name: str, dims: int) -> str:
    if dims > 1:
        return "normal"
    return "zeros" if name.endswith(("bias", "sinks")) else "ones"


def _nbytes(plan: TensorPlan, dtype: torch.dtype) -> int:
    return math.prod(plan.shape) * dtype.itemsize


def _generate(plan: TensorPlan, *, seed: int, dtype: torch.dtype) -> torch.Tensor:
    if plan.init in ("ones", "zeros"):
        return (torch.ones if plan.init == "ones" else torch.zeros)(plan.shape, dtype=dtype)
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

    real = preset_config(preset)
    if layers < 1:
        raise ValueError(f"layers must be positive, got {layers}")
    vocab = vocab or (overrides or {}).get("vocab_size") or real["vocab_size"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    max_positions = (overrides or {}).get("max_position_embeddings", real["max_position_embeddings"])
    tokenizer = tok.make_tokenizer(out, vocab, seed=seed, model_max_length=max_positions)
    ids = {f"{role}_token_id": tokenizer.token_to_id(token)
           for role, token in (("bos", tok.BOS), ("eos", tok.EOS), ("pad", tok.PAD))}
    config = build_config(preset, layers=layers, vocab=vocab, dtype=dtype, special_ids=ids,
                          overrides={k: v for k, v in (overrides or {}).items() if k != "vocab_size"})
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)

    plans = plan_tensors(preset, config)
    if not any(".experts." in p.name for p in plans):
        raise ValueError(f"{preset} with {layers} layer(s) has no MoE layer (its first layers are dense): give more "
                         "layers")
    shards = split_into_shards(plans, lambda p: _nbytes(p, dtype), max_shard_bytes)
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
