"""What a sweep runs: units of work, each a few cases that share their weights.

    LayerUnit  one layer shape x one weight format x one experts impl, its token counts M: the weights are made
               (and packed) once, then each M is timed -> one `layer` row per M
    ModelUnit  one checkpoint (or a synthetic one, built in a temporary directory) x one experts impl, its
               (batch, input length, output length) runs: the engine loads once -> one `model` row per run

A unit knows its case dicts (the DB's resume key), what memory it needs (cpumoe.bench.sweep.memory) and roughly
how long it takes. Units are plain dataclasses: they travel to Ray workers as they are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from cpumoe.bench.sweep.grid import Shape
from cpumoe.bench.sweep.memory import PROCESS_BYTES, is_tmpfs
from cpumoe.bench.sweep.rows import format_label, layer_case, model_case
from cpumoe.presets import LayerPreset

QUICK_PROBE_BYTES = 256 << 20   # the layer bench's and model bench's probe in quick mode
FULL_PROBE_BYTES = 1 << 30
# Time model of the layer level, measured on this project's 2-core EPYC: random bf16 weights and their packed copy
# take ~6 s per GB; each unit builds its input pools (~2.5 s for Mixtral's H); each M costs a warm-up call, a
# few timed calls and one bandwidth probe per timed call (the paper grid: 3 min estimated, 2 min 56 s measured).
MAKE_S_PER_GB = 6.0
UNIT_SETUP_S = 2.5
# Not measured, guesses that err long: quantizing (float32 temporaries per chunk), and a checkpoint written,
# then loaded and packed.
QUANTIZE_S_PER_GB = 12.0
LOAD_S_PER_GB = 4.0


@dataclass(frozen=True, slots=True)
class LayerUnit:
    """One layer shape (the skeleton's routing and activation, `shape`'s sizes), one weight format, one experts
    backend, timed at each of `tokens`."""
    bench: ClassVar[str] = "layer"
    skeleton: LayerPreset
    shape: Shape
    format: str              # as `bench layer --dtype` takes it: bf16, fp32, int8, int4_w4a16, ...
    group_size: int
    impl: str                # "fused" (the oracle's backend) or "naive"
    backend: str             # the backend that runs; "none" when no backend can (the unit then records errors)
    tokens: tuple[int, ...]
    threads: int
    quick: bool = True
    refusal: str = ""        # why no backend can run it (backend "none")

    @property
    def preset(self) -> LayerPreset:
        return self.shape.preset(self.skeleton)

    @property
    def format_label(self) -> str:
        from cpumoe.bench.layer import parse_weight_format
        fmt = parse_weight_format(self.format, self.group_size)
        return format_label(fmt.name, fmt.group_size)

    @property
    def label(self) -> str:
        s = self.shape
        return f"H={s.hidden} I={s.inter} E={s.experts} k={s.top_k} {self.format_label} {self.backend}"

    def cases(self) -> list[dict[str, Any]]:
        s = self.shape
        return [layer_case(preset=self.skeleton.name, hidden=s.hidden, inter=s.inter, experts=s.experts,
                           top_k=s.top_k, format=self.format_label, backend=self.backend, tokens=m,
                           threads=self.threads)
                for m in self.tokens]

    def keep(self, cases: list[dict[str, Any]]) -> LayerUnit:
        """This unit with only these of its cases."""
        return replace(self, tokens=tuple(c["tokens"] for c in cases))

    def bytes_needed(self) -> int:
        from cpumoe.bench import layer as lb
        from cpumoe.quant.schemes import SLICE_TEMPORARY_BYTES

        preset = self.preset
        fmt = lb.parse_weight_format(self.format, self.group_size)
        master = lb.weights_nbytes(preset, fmt.dtype if fmt.quant is None else lb.REFERENCE_DTYPE)
        need = master + PROCESS_BYTES + (QUICK_PROBE_BYTES if self.quick else FULL_PROBE_BYTES)
        if fmt.quant is not None:   # the quantized stack, and the quantizer's temporaries of a slice
            need += lb.quantized_nbytes(preset, fmt) + SLICE_TEMPORARY_BYTES
        if self.backend != "none":
            try:
                need += lb.case_nbytes(preset, lb.Case(fmt, self.backend))
            except ValueError:   # a shape the format cannot take: the run says so as an error row
                pass
        M, k, H, I, E = max(self.tokens), preset.top_k, preset.hidden, preset.inter, preset.experts
        need += lb.INPUT_POOL * M * (H + E) * 4 + 4 * M * k * (3 * I + H) * 4   # inputs; the experts' activations
        if M >= lb.MM_FROM_TOKENS:
            need += 3 * 4096 * 4096 * 4
        return need

    def estimate_s(self, bandwidth_gbs: float, mm_gflops: float) -> float:
        """Rough seconds this unit takes on a machine of this read bandwidth and GEMM rate."""
        from cpumoe.bench import layer as lb

        preset = self.preset
        fmt = lb.parse_weight_format(self.format, self.group_size)
        gb = lb.weights_nbytes(preset, lb.REFERENCE_DTYPE) / 1e9
        seconds = UNIT_SETUP_S * preset.hidden / 4096 + MAKE_S_PER_GB * gb
        if fmt.quant is not None:
            seconds += QUANTIZE_S_PER_GB * gb
        expert_bytes = 3 * preset.hidden * preset.inter * (4 if fmt.dtype.itemsize == 4 else 2)
        probe_s = (QUICK_PROBE_BYTES if self.quick else FULL_PROBE_BYTES) / (bandwidth_gbs * 1e9)
        for m in self.tokens:
            touched = min(preset.experts, m * preset.top_k) * expert_bytes
            call = max(touched / (bandwidth_gbs * 1e9), 2 * m * preset.top_k * 3 * preset.hidden * preset.inter /
                       (mm_gflops * 1e9))
            if self.impl == "naive":
                call *= 2
            reps = lb.repetitions_for(call, self.quick)
            seconds += call * (1 + reps) + probe_s * reps
        return seconds


@dataclass(frozen=True, slots=True)
class SyntheticModel:
    """A synthetic checkpoint to build per unit: `preset`'s model with this layer shape, `layers` decoder layers, a
    `vocab`-token vocabulary, and `overrides` of its config (tests: tiny attention)."""
    preset: str
    shape: Shape
    layers: int
    vocab: int
    dtype: str = "bf16"
    overrides: tuple[tuple[str, Any], ...] = ()

    def config_overrides(self) -> dict[str, Any]:
        from cpumoe.synthetic.checkpoint import layer_shape_overrides
        return dict(self.overrides, **layer_shape_overrides(self.preset, hidden=self.shape.hidden,
                                                            inter=self.shape.inter, experts=self.shape.experts,
                                                            top_k=self.shape.top_k))

    def weights_bytes(self) -> tuple[int, int]:
        """(bytes of every tensor, bytes of the largest shard make_checkpoint writes)."""
        from cpumoe.bench.layer import FLOAT_DTYPES
        from cpumoe.synthetic.checkpoint import MAX_SHARD_BYTES, build_config, plan_tensors

        dtype = FLOAT_DTYPES[self.dtype]
        config = build_config(self.preset, layers=self.layers, vocab=self.vocab, dtype=dtype,
                              special_ids=dict(bos_token_id=0, eos_token_id=1, pad_token_id=2),
                              overrides=self.config_overrides())
        sizes = [math.prod(p.shape) * dtype.itemsize for p in plan_tensors(self.preset, config)]
        return sum(sizes), min(sum(sizes), max(MAX_SHARD_BYTES, max(sizes)))

    def kv_bytes_per_token(self) -> int:
        from cpumoe.synthetic.checkpoint import preset_config
        config = dict(preset_config(self.preset), **dict(self.overrides))
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or self.shape.hidden // heads
        return 2 * self.layers * config["num_key_value_heads"] * head_dim * 2


@dataclass(frozen=True, slots=True)
class ModelUnit:
    """A checkpoint directory (`source` a str) or a synthetic checkpoint to build (`source` a SyntheticModel), on
    one experts impl, through each of `runs` (batch, input length, output length)."""
    bench: ClassVar[str] = "model"
    source: str | SyntheticModel
    name: str                # the case's short model name
    format: str              # the case's format label
    dtype: str | None        # --dtype (None: the checkpoint's)
    impl: str
    shape: dict[str, int | None] = field(hash=False)
    layers: int | None       # N of a synthetic checkpoint, None for one run as it is
    runs: tuple[tuple[int, int, int], ...]
    threads: int
    weights_bytes: int       # as loaded
    kv_per_token: int
    quick: bool = True
    repeats: int = 1
    tmp_dir: str | None = None
    shard_bytes: int = 0     # a synthetic checkpoint's largest shard while it is written

    @property
    def label(self) -> str:
        s = self.shape
        where = f"H={s['hidden']} I={s['inter']} E={s['experts']} k={s['top_k']}" \
            if isinstance(self.source, SyntheticModel) else self.name
        return f"{where} {self.format} {self.impl}"

    def cases(self) -> list[dict[str, Any]]:
        return [model_case(model=self.name, format=self.format, batch=b, input_len=i, output_len=o,
                           threads=self.threads, impl=self.impl, layers=self.layers, shape=self.shape)
                for b, i, o in self.runs]

    def keep(self, cases: list[dict[str, Any]]) -> ModelUnit:
        return replace(self, runs=tuple((c["batch"], c["input_len"], c["output_len"]) for c in cases))

    def kv_cache_bytes(self) -> int:
        from cpumoe.bench.model import ModelCase, engine_config
        config = engine_config([ModelCase(*r) for r in self.runs])
        return config.num_blocks * config.block_size * self.kv_per_token

    def bytes_needed(self) -> int:
        from cpumoe.bench.model import MM_SIZE, QUICK_MM_SIZE

        mm = (QUICK_MM_SIZE if self.quick else MM_SIZE) ** 2 * 3 * 4
        tokens = max(max(1024, b * i) for b, i, _ in self.runs)   # a prefill step's tokens, at most
        hidden = self.shape["hidden"] or 4096
        need = max(self.weights_bytes, self.shard_bytes) + self.kv_cache_bytes() + mm + PROCESS_BYTES
        need += (QUICK_PROBE_BYTES if self.quick else FULL_PROBE_BYTES) + tokens * hidden * 8 * 4
        if isinstance(self.source, SyntheticModel) and is_tmpfs(self.tmp_dir or _tempdir()):
            need += self.weights_bytes   # the files themselves are in memory
        return need

    def estimate_s(self, bandwidth_gbs: float, mm_gflops: float) -> float:
        """Rough: loading, then per run (a warm-up and the repetitions) a prefill at the GEMM rate and a decode
        reading every weight each step."""
        seconds = LOAD_S_PER_GB * self.weights_bytes / 1e9 * (2 if isinstance(self.source, SyntheticModel) else 1)
        for b, i, o in self.runs:
            prefill = 2 * b * i * self.weights_bytes / 2 / (mm_gflops * 1e9)
            decode = o * self.weights_bytes / (bandwidth_gbs * 1e9)
            seconds += (1 + self.repeats) * (prefill + decode)
        return seconds


def _tempdir() -> str:
    import tempfile
    return tempfile.gettempdir()
