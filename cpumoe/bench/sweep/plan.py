"""The units of each sweep, from its axes (cpumoe.bench.sweep.grid) and options.

    layer       shapes (one axis at a time around the skeleton) x formats x experts impls -> LayerUnit (its Ms)
    arch-model  shapes x float dtypes x impls -> ModelUnit of a synthetic checkpoint of N layers (its runs)
    model       checkpoints x impls -> ModelUnit (its batch x input x output runs)
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cpumoe.bench.sweep.cases import LayerUnit, ModelUnit, SyntheticModel
from cpumoe.bench.sweep.grid import Shape
from cpumoe.presets import LayerPreset

IMPLS = ("fused", "naive")


@dataclass(frozen=True, slots=True)
class RunOptions:
    threads: int
    quick: bool = True
    repeats: int = 1          # model level: runs per case, the median by end-to-end time is kept


def layer_units(skeleton: LayerPreset, shapes: Sequence[Shape], formats: Sequence[str], impls: Sequence[str],
                tokens: Sequence[int], options: RunOptions, group_size: int = 128) -> list[LayerUnit]:
    """One unit per (shape, format, impl). The fused impl runs the backend the oracle chooses for the shape and
    format; when none can, the unit carries the refusal and records it as errors."""
    from cpumoe.bench.layer import experts_config, parse_weight_format
    from cpumoe.experts import NoSupportedBackend, choose_backend

    units = []
    for shape, name, impl in itertools.product(shapes, formats, impls):
        fmt = parse_weight_format(name, group_size)
        backend, refusal = "naive", ""
        if impl == "fused":
            try:
                backend = choose_backend(experts_config(shape.preset(skeleton), fmt)).name
            except NoSupportedBackend as e:
                backend, refusal = "none", str(e)
        units.append(LayerUnit(skeleton=skeleton, shape=shape, format=name, group_size=group_size, impl=impl,
                               backend=backend, tokens=tuple(tokens), threads=options.threads, quick=options.quick,
                               refusal=refusal))
    return units


def runs_of(batch: Sequence[int], input_len: Sequence[int], output_len: Sequence[int]) -> tuple:
    return tuple(itertools.product(batch, input_len, output_len))


def arch_model_units(skeleton: str, shapes: Sequence[Shape], dtypes: Sequence[str], impls: Sequence[str],
                     runs: tuple, options: RunOptions, *, layers: int, vocab: int, tmp_dir: str | None = None,
                     overrides: dict | None = None) -> list[ModelUnit]:
    """One unit per (shape, dtype, impl): a synthetic `skeleton` checkpoint of `layers` layers, written to a
    temporary directory under `tmp_dir` while the unit runs."""
    units = []
    for shape, dtype, impl in itertools.product(shapes, dtypes, impls):
        model = SyntheticModel(preset=skeleton, shape=shape, layers=layers, vocab=vocab, dtype=dtype,
                               overrides=tuple(sorted((overrides or {}).items())))
        total, shard = model.weights_bytes()
        units.append(ModelUnit(
            source=model, name=f"{skeleton}-synthetic-v{vocab}" + ("-tiny" if overrides else ""), format=dtype,
            dtype=dtype, impl=impl,
            shape=dict(hidden=shape.hidden, inter=shape.inter, experts=shape.experts, top_k=shape.top_k),
            layers=layers, runs=runs, threads=options.threads, weights_bytes=total,
            kv_per_token=model.kv_bytes_per_token(), quick=options.quick, repeats=options.repeats, tmp_dir=tmp_dir,
            shard_bytes=shard))
    return units


def model_units(checkpoints: Sequence[str], names: Sequence[str] | None, dtype: str | None, impls: Sequence[str],
                runs: tuple, options: RunOptions) -> list[ModelUnit]:
    """One unit per (checkpoint, impl). ValueError for a checkpoint that is missing or unreadable."""
    from cpumoe.bench.sweep.rows import checkpoint_format, checkpoint_shape

    if names is not None and len(names) != len(checkpoints):
        raise ValueError(f"--names gives {len(names)} names for {len(checkpoints)} checkpoints")
    units = []
    for i, path in enumerate(checkpoints):
        name = names[i] if names is not None else Path(path).resolve().name
        loaded, kv = loaded_bytes(path, dtype)
        for impl in impls:
            units.append(ModelUnit(source=str(path), name=name, format=checkpoint_format(path, dtype), dtype=dtype,
                                   impl=impl, shape=checkpoint_shape(path), layers=None, runs=runs,
                                   threads=options.threads, weights_bytes=loaded, kv_per_token=kv,
                                   quick=options.quick, repeats=options.repeats))
    names_seen = [u.name for u in units if u.impl == impls[0]]
    if len(set(names_seen)) != len(names_seen):
        raise ValueError("two checkpoints have the same directory name: give each a --names entry")
    return units


def loaded_bytes(path: str, dtype: str | None) -> tuple[int, int]:
    """(the checkpoint's weights as loaded in `dtype`, KV cache bytes per token) from its files and config.json."""
    from cpumoe.bench.layer import FLOAT_DTYPES
    from cpumoe.loader import Checkpoint
    from cpumoe.loader.quantized import QuantizedCheckpoint

    ckpt = Checkpoint(path)
    size = ckpt.weights_bytes
    stored = ckpt.torch_dtype
    target = FLOAT_DTYPES[dtype] if dtype else (stored or FLOAT_DTYPES["fp32"])
    if QuantizedCheckpoint(ckpt).format is None and stored is not None and stored != target:
        size = size * target.itemsize // stored.itemsize
    get = lambda *keys, default=None: ckpt.config_get(*keys, default=default)  # noqa: E731
    hidden, heads = get("hidden_size"), get("num_attention_heads", default=1)
    if get("kv_lora_rank") is not None:   # MLA caches the compressed latent and the rope key
        per_layer = get("kv_lora_rank") + get("qk_rope_head_dim", default=0)
    else:
        head_dim = get("head_dim") or hidden // heads
        per_layer = 2 * get("num_key_value_heads", default=heads) * head_dim
    return size, get("num_hidden_layers", default=1) * per_layer * target.itemsize
