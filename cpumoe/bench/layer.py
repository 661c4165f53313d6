"""The MoE layer benchmark: one layer shape, a list of weight formats, every experts backend this CPU can run for
each, a list of token counts.

    random weights (seeded, once per float dtype) -> per format: quantize once (cpumoe.quant)
        -> per (format, backend): FusedMoE(backend=backend) -> per M: time layer(hidden, router_logits)
        -> GFLOP/s, GB/s of the distinct experts' weights as the backend stores them, vs the machine's limits,
           the naive loop of the same format, and the bf16 fused backend

A format is a float dtype (bf16, fp32, fp16: weights and activations) or a cpumoe.quant format (int8_w8a8,
int4_w4a16, fp8_w8a16, mxfp4_w4a16) over bf16 activations. The timed call includes routing (select_experts), as
a model's forward does. Shared experts are not part of the layer (FusedMoE runs the routed experts only).

Bytes: each row counts the bytes its backend's prepared weights hold per expert (packed blocks with their
scales/zeros for quantized formats on the kernel backends; the dequantized weights on the naive loop) times the
distinct experts the routing chose. "vs bf16" is the speed-up over the bf16 fused backend (the fastest measured
bf16 backend other than naive) in the same repetitions, printed beside the issue's target; for decode it also
prints the bound from bytes (bf16 bytes / the row's bytes), which a weight stream cannot beat.

Side by side: this machine is shared and its memory bandwidth drifts by tens of percent over minutes, so the
cases are measured repetition by repetition in turn, and each repetition starts with a streaming read of a
1 GiB buffer (the bandwidth probe) that is also timed: "% bandwidth" compares a case with it (below). The
probe also evicts the caches, and repetitions rotate over INPUT_POOL inputs with different routing, so no call
finds its experts in the last-level cache (a model runs other layers between two calls of this one). For
compute-bound cases (M >= MM_FROM_TOKENS) a torch.mm of mm_size^3 joins each repetition and "% mm peak"
compares with its median. The cases take turns at coming first after the probe (and
mm): the first call after that 1 GiB read was 0.2-0.4 ms slower here whatever its size (after a layer's
stream, 0.1), a quarter of a quantized decode call, and in a fixed order the same case paid it every time.
Ratios are taken pair by pair, as `bench model` takes them: "% bw" is the median over the repetitions of each
call's GB/s over the probe of its own repetition, and "vs bf16" the median of the ratios of the reference's call
and the case's in each repetition, each with its interquartile range, so a drift of the machine between
repetitions moves neither. "kernel" is "% bw" over the time the native experts kernel took by its own clock
(ops.experts_kernel_clock), without the Python, the dispatcher and the routing around it: at M = 1 those took
~0.1 ms of a 0.8-2.8 ms call here, their code having left the caches while the other cases streamed. Each case
packs its own copy of the weights; when all the copies would not fit in memory, the formats run one after the
other, and then the cases one by one, each group timing the bf16 reference beside it so the ratios stay side by
side.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cpumoe import ops
from cpumoe.bench.machine import MachineInfo, OtherCpuUse, measure_machine
from cpumoe.experts import ExpertsConfig, all_backends, choose_backend
from cpumoe.layer import FusedMoE
from cpumoe.presets import LayerPreset
from cpumoe.quant import MXFP4_GROUP, QuantFormat, parse_format, quantize
from cpumoe.routing import select_experts

TARGET_S = 0.75       # time each case for about this long
MIN_REPS = 3
MAX_REPS = 30
INPUT_POOL = 4        # inputs with different routing, rotated over the repetitions
MM_FROM_TOKENS = 256  # from this M on, a torch.mm joins each repetition as the side-by-side GEMM peak
MEMORY_SHARE = 0.6    # build every case's layer at once only if their weights fit in this share of free memory
SLOW_CALL_S = 2.0     # a call this slow (a slow backend at large M) gets only SLOW_REPS repetitions
SLOW_REPS = 2
QUICK_TARGET_S = 0.05  # --quick: one warm-up, then up to QUICK_MAX_REPS calls within about this long
QUICK_MAX_REPS = 3
BUSY_FRACTION = 0.05  # warn when other processes took this share of the CPUs during the run

FLOAT_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
                "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}
QUANT_ACTIVATIONS = torch.bfloat16   # quantized formats run on bf16 activations here
REFERENCE_DTYPE = torch.bfloat16     # "vs bf16": the fastest measured bf16 backend other than naive

# The speed-ups over the bf16 fused backend the quantized backends aim at (the targets), by regime:
# decode is M <= DECODE_MAX_TOKENS, prefill M >= PREFILL_MIN_TOKENS; none are stated in between.
DECODE_MAX_TOKENS = 8
PREFILL_MIN_TOKENS = 2048
TARGETS = {
    "decode": {QuantFormat.INT8_W8A8: 1.8, QuantFormat.INT4_W4A16: 2.8, QuantFormat.MXFP4_W4A16: 2.8,
               QuantFormat.FP8_W8A16: 1.6},
    "prefill": {QuantFormat.INT8_W8A8: 1.6, QuantFormat.INT4_W4A16: 1.2, QuantFormat.FP8_W8A16: 0.9,
                QuantFormat.MXFP4_W4A16: 0.9},
}


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """A case's weights: a float dtype (weights and activations), or a quantized format over `dtype` activations.
    group_size is the kernels' group (ExpertsConfig.group_size): 0 for a whole row."""
    dtype: torch.dtype
    quant: QuantFormat | None = None
    group_size: int = 0

    @property
    def name(self) -> str:
        return self.quant.value if self.quant is not None else str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        """e.g. "int4_w4a16 g128 (bf16 activations)"."""
        if self.quant is None:
            return self.name
        group = f" g{self.group_size}" if self.group_size else " per channel"
        return f"{self.name}{group} ({str(self.dtype).removeprefix('torch.')} activations)"


def parse_weight_format(name: str, group_size: int = 128) -> WeightFormat:
    """bf16/fp32/fp16 (or their torch names), or a quantized format or alias: int8, int4, fp8, mxfp4.
    group_size: int4's group and fp8's k block (int8 is per channel, mxfp4 groups of 32)."""
    if name in FLOAT_DTYPES:
        return WeightFormat(FLOAT_DTYPES[name])
    try:
        fmt = parse_format(name)
    except ValueError:
        raise ValueError(f"unknown dtype {name!r}; choose from bf16, fp32, fp16, int8, int4, fp8, mxfp4 (or "
                         f"{', '.join(f.value for f in QuantFormat)})") from None
    if group_size < 1:
        raise ValueError(f"group size must be positive, got {group_size}")
    group = {QuantFormat.INT8_W8A8: 0, QuantFormat.MXFP4_W4A16: MXFP4_GROUP}.get(fmt, group_size)
    return WeightFormat(QUANT_ACTIVATIONS, fmt, group)


def check_format(preset: LayerPreset, fmt: WeightFormat) -> None:
    """ValueError when the layer's shape cannot take the format's groups (K = H for w13, I for w2)."""
    q, g = fmt.quant, fmt.group_size
    if q is QuantFormat.INT4_W4A16 and (preset.hidden % g or preset.inter % g or g % 32):
        raise ValueError(f"int4 group size {g} must be a multiple of 32 dividing H={preset.hidden} and "
                         f"I={preset.inter} (try --group-size)")
    if q is QuantFormat.FP8_W8A16 and g % 2:
        raise ValueError(f"fp8 k block {g} must be even")
    if q is QuantFormat.MXFP4_W4A16 and (preset.hidden % MXFP4_GROUP or preset.inter % MXFP4_GROUP):
        raise ValueError(f"mxfp4 needs H={preset.hidden} and I={preset.inter} to be multiples of {MXFP4_GROUP}")


@dataclass(frozen=True, slots=True)
class Case:
    """One measured row family: a weight format on one experts backend."""
    format: WeightFormat
    backend: str

    @property
    def label(self) -> str:
        return f"{self.format.name} {self.backend}"


@dataclass(frozen=True, slots=True)
class LayerCase:
    """One timed call: M tokens through a layer of E experts, H x I each, k per token."""
    hidden: int
    inter: int
    experts: int
    top_k: int
    tokens: int
    dtype: torch.dtype
    distinct_experts: int | None = None   # experts in this input's topk_ids; None: the most there can be

    def flops(self) -> int:
        """2 x M x k x 3 x H x I: w13 is [2I, H] and w2 [H, I] per expert."""
        return 2 * self.tokens * self.top_k * 3 * self.hidden * self.inter

    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.inter * self.dtype.itemsize

    def bytes(self) -> int:
        """Bytes of the distinct expert weights this input touches (biases not counted)."""
        distinct = self.distinct_experts
        if distinct is None:
            distinct = min(self.experts, self.tokens * self.top_k)
        return distinct * self.expert_bytes()


@dataclass(slots=True)
class LayerResult:
    format: str                  # WeightFormat.name: "bfloat16", "int8_w8a8", ...
    backend: str
    tokens: int
    ms: float                    # median per call
    repetitions: int
    distinct_experts: int
    expert_bytes: int            # bytes of one expert's weights as this backend holds them (packed, scales included)
    gflops: float
    gbs: float                   # distinct_experts * expert_bytes / time
    bandwidth_gbs: float         # the bandwidth probe's median over this case's repetitions
    bandwidth_pct: float         # gbs / bandwidth_gbs
    mm_gflops: float             # torch.mm's median over the repetitions (M >= MM_FROM_TOKENS), else the run's
    peak_pct: float              # gflops / mm_gflops
    speedup_vs_naive: float | None = None     # the naive loop of the same format / this
    speedup_vs_bf16: float | None = None      # the bf16 fused backend in the same repetitions / this
    target_vs_bf16: float | None = None       # the target for speedup_vs_bf16 (quantized formats)
    bytes_bound_vs_bf16: float | None = None  # decode: bf16 bytes / this row's bytes, the most a stream allows
    ms_min: float | None = None               # the fastest and slowest of the timed calls
    ms_max: float | None = None
    times_ms: list[float] = field(default_factory=list)   # each repetition's call, in repetition order
    bandwidth_pct_range: tuple[float, float] | None = None    # interquartile range of the repetitions' % of probe
    # % of the probe over the time the native experts kernel itself took (ops.experts_kernel_clock): the call less
    # its Python, dispatch and routing; None for a backend that runs no native kernel (naive)
    kernel_bandwidth_pct: float | None = None
    speedup_vs_bf16_range: tuple[float, float] | None = None  # interquartile range of the paired ratios


@dataclass(slots=True)
class LayerInputs:
    case: LayerCase
    hidden_states: torch.Tensor  # [M, H]
    router_logits: torch.Tensor  # [M, E]


def experts_config(preset: LayerPreset, fmt: WeightFormat | torch.dtype) -> ExpertsConfig:
    if isinstance(fmt, torch.dtype):
        fmt = WeightFormat(fmt)
    return ExpertsConfig(hidden_size=preset.hidden, inter_size=preset.inter, num_experts=preset.experts,
                         top_k=preset.top_k, dtype=fmt.dtype, activation=preset.activation, has_bias=preset.bias,
                         apply_router_weight_on_input=preset.router_weight_on_input,
                         quantization=fmt.quant.value if fmt.quant is not None else "none",
                         group_size=fmt.group_size)


def select_backends(config: ExpertsConfig, names: Sequence[str] | None = None) -> list[str]:
    """Every backend that supports `config`, fastest first; or the named ones (ValueError if unknown/unsupported)."""
    report = {p.name: p.is_supported(config) for p in all_backends()}
    if names is None:
        return [name for name, (ok, _) in report.items() if ok]
    for name in names:
        if name not in report:
            raise ValueError(f"unknown backend {name!r}; known: {', '.join(report)}")
        ok, why = report[name]
        if not ok:
            raise ValueError(f"backend {name!r} cannot run this layer: {why}")
    return [name for name in report if name in names]


def select_cases(preset: LayerPreset, formats: Sequence[WeightFormat], names: Sequence[str] | None = None
                 ) -> tuple[list[Case], list[dict]]:
    """(cases, unrun): every (format, backend) that can run, formats in the given order and backends fastest first
    (of `names` if given); and for each format no backend (of those) can run, {"format", "reasons": {backend: why}}.
    ValueError for an unknown backend name, a shape the format cannot take, or when nothing at all can run."""
    known = [p.name for p in all_backends()]
    for name in names or ():
        if name not in known:
            raise ValueError(f"unknown backend {name!r}; known: {', '.join(known)}")
    cases, unrun = [], []
    for fmt in formats:
        check_format(preset, fmt)
        config = experts_config(preset, fmt)
        report = {p.name: p.is_supported(config) for p in all_backends() if names is None or p.name in names}
        runnable = [name for name, (ok, _) in report.items() if ok]
        cases += [Case(fmt, name) for name in runnable]
        if not runnable:
            unrun.append(dict(format=fmt.name, reasons={name: why for name, (_, why) in report.items()}))
    if not cases:
        raise ValueError("no backend can run any of these formats:\n" + "\n".join(
            f"  {u['format']}: " + "; ".join(f"{n}: {why}" for n, why in u["reasons"].items()) for u in unrun))
    return cases, unrun


def reference_case(cases: Sequence[Case]) -> Case | None:
    """The bf16 fused backend the other rows are compared with: the first (fastest) bf16 case that is not naive."""
    return next((c for c in cases if c.format.quant is None and c.format.dtype == REFERENCE_DTYPE
                 and c.backend != "naive"), None)


def make_weights(preset: LayerPreset, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Random w13 [E, 2I, H], w2 [E, H, I] (and biases) scaled by 1/sqrt(fan_in), made directly in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    E, H, I = preset.experts, preset.hidden, preset.inter
    w13 = torch.randn(E, 2 * I, H, generator=g, dtype=dtype).mul_(H**-0.5)  # [E, 2I, H]
    w2 = torch.randn(E, H, I, generator=g, dtype=dtype).mul_(I**-0.5)       # [E, H, I]
    w13_bias = torch.randn(E, 2 * I, generator=g, dtype=dtype).mul_(H**-0.5) if preset.bias else None
    w2_bias = torch.randn(E, H, generator=g, dtype=dtype).mul_(I**-0.5) if preset.bias else None
    return dict(w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias)


def quantize_weights(weights: dict[str, torch.Tensor | None], fmt: WeightFormat) -> dict:
    """w13 and w2 as QuantizedWeight stacks of `fmt`; biases in the activations' dtype."""
    bias = lambda b: None if b is None else b.to(fmt.dtype)  # noqa: E731
    return dict(w13=quantize(weights["w13"], fmt.quant, fmt.group_size or None),
                w2=quantize(weights["w2"], fmt.quant, fmt.group_size or None),
                w13_bias=bias(weights["w13_bias"]), w2_bias=bias(weights["w2_bias"]))


def make_inputs(preset: LayerPreset, tokens: int, dtype: torch.dtype, seed: int = 1) -> LayerInputs:
    g = torch.Generator().manual_seed(seed * 100_003 + tokens)
    hidden_states = torch.randn(tokens, preset.hidden, generator=g).to(dtype)      # [M, H]
    router_logits = torch.randn(tokens, preset.experts, generator=g).to(dtype)     # [M, E]
    _, topk_ids = select_experts(router_logits, preset.top_k, scoring=preset.router_scoring,
                                 renormalize=preset.renormalize)                   # [M, k]
    case = LayerCase(hidden=preset.hidden, inter=preset.inter, experts=preset.experts, top_k=preset.top_k,
                     tokens=tokens, dtype=dtype, distinct_experts=int(torch.unique(topk_ids).numel()))
    return LayerInputs(case, hidden_states, router_logits)


def build_layer(preset: LayerPreset, weights: dict, backend: str, dtype: torch.dtype | None = None) -> FusedMoE:
    """FusedMoE on `backend` over float weights, or over QuantizedWeight stacks with `dtype` activations."""
    return FusedMoE(weights["w13"], weights["w2"], w13_bias=weights["w13_bias"], w2_bias=weights["w2_bias"],
                    top_k=preset.top_k, activation=preset.activation, scoring=preset.router_scoring,
                    renormalize=preset.renormalize, apply_router_weight_on_input=preset.router_weight_on_input,
                    backend=backend, dtype=dtype)


def layer_expert_bytes(layer: FusedMoE) -> int:
    """Bytes of one expert's w13 + w2 as the layer's backend holds them (packed blocks with scales and zeros, or
    the naive loop's dense weights); biases not counted."""
    p = layer.prepared
    return (p.w13.numel() * p.w13.element_size() + p.w2.numel() * p.w2.element_size()) // p.w13.shape[0]


def repetitions_for(estimate: float, quick: bool) -> int:
    """How many timed calls a case gets, from one call's duration."""
    if quick:
        return min(QUICK_MAX_REPS, max(1, math.ceil(QUICK_TARGET_S / max(estimate, 1e-9))))
    if estimate >= SLOW_CALL_S:
        return SLOW_REPS
    return min(MAX_REPS, max(MIN_REPS, math.ceil(TARGET_S / max(estimate, 1e-9))))


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_tokens(layers: dict[Case, FusedMoE], pools: dict[torch.dtype, list[LayerInputs]], probe,
                   machine: MachineInfo, quick: bool = False) -> dict[Case, LayerResult]:
    """One M, every layer in `layers`, interleaved repetition by repetition with the bandwidth probe (and mm).
    pools: the inputs per activation dtype (every case of one dtype sees the same routing)."""
    call = {case: (lambda inputs, layer=layer: layer(inputs.hidden_states, inputs.router_logits))
            for case, layer in layers.items()}
    pool_of = {case: pools[case.format.dtype] for case in layers}
    tokens = next(iter(pools.values()))[0].case.tokens
    with torch.inference_mode():
        reps = {case: repetitions_for(_timed(lambda: fn(pool_of[case][0])), quick) for case, fn in call.items()}
        mm = _mm_call(machine) if tokens >= MM_FROM_TOKENS else None
        times: dict[Case, list[float]] = {case: [] for case in call}
        kernel: dict[Case, list[float | None]] = {case: [] for case in call}
        bandwidth, mm_seconds = [], []
        for rep in range(max(reps.values())):
            bandwidth.append(probe.read_gbps())
            if mm is not None:
                mm_seconds.append(_timed(mm))
            for case in turn_order(list(call), rep):
                fn = call[case]
                if rep < reps[case]:
                    inputs = pool_of[case][rep % INPUT_POOL]
                    calls = ops.experts_kernel_clock()[0]
                    times[case].append(_timed(lambda: fn(inputs)))
                    after, kernel_s = ops.experts_kernel_clock()
                    kernel[case].append(kernel_s if after == calls + 1 else None)
    gbps = statistics.median(bandwidth)
    mm_gflops = (2 * machine.mm_size**3 / statistics.median(mm_seconds) / 1e9) if mm_seconds else machine.mm_gflops
    results = {}
    for case, ts in times.items():
        pool = pool_of[case]
        distinct = statistics.mean(i.case.distinct_experts for i in pool)
        expert_bytes = layer_expert_bytes(layers[case])
        seconds = statistics.median(ts)
        gflops = pool[0].case.flops() / seconds / 1e9
        gbs = distinct * expert_bytes / seconds / 1e9
        # each call's bytes (its repetition's input) per second over its own repetition's probe
        def pct(rep: int, seconds: float) -> float:
            return 100 * pool[rep % INPUT_POOL].case.distinct_experts * expert_bytes / seconds / 1e9 / bandwidth[rep]
        pcts = [pct(rep, t) for rep, t in enumerate(ts)]
        kernel_pcts = [pct(rep, k) for rep, k in enumerate(kernel[case]) if k is not None]
        results[case] = LayerResult(
            format=case.format.name, backend=case.backend, tokens=tokens, ms=seconds * 1e3, repetitions=len(ts),
            distinct_experts=round(distinct), expert_bytes=expert_bytes, gflops=gflops, gbs=gbs,
            bandwidth_gbs=gbps, bandwidth_pct=statistics.median(pcts), mm_gflops=mm_gflops,
            peak_pct=100 * gflops / mm_gflops, ms_min=min(ts) * 1e3, ms_max=max(ts) * 1e3,
            times_ms=[t * 1e3 for t in ts], bandwidth_pct_range=interquartile(pcts),
            kernel_bandwidth_pct=statistics.median(kernel_pcts) if len(kernel_pcts) == len(ts) else None)
    return results


def turn_order(cases: list, rep: int) -> list:
    """The order of the cases in repetition `rep`: each comes first after the probe in turn."""
    k = rep % len(cases) if cases else 0
    return cases[k:] + cases[:k]


def interquartile(values: Sequence[float]) -> tuple[float, float]:
    """The 25th and 75th percentiles (the extremes of fewer than four values)."""
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def _mm_call(machine: MachineInfo) -> Callable[[], object]:
    dtype = getattr(torch, machine.mm_dtype)
    a = torch.randn(machine.mm_size, machine.mm_size).to(dtype)
    b = torch.randn(machine.mm_size, machine.mm_size).to(dtype)
    return lambda: torch.mm(a, b)


def compare_with_reference(results: dict[Case, LayerResult], reference: Case | None) -> None:
    """speedup_vs_bf16 (and for decode bytes_bound_vs_bf16) from the reference timed in the same repetitions: the
    median of the repetitions' ratios with their interquartile range (the ratio of the medians for results
    without per-repetition times)."""
    ref = results.get(reference) if reference is not None else None
    if ref is None:
        return
    for r in results.values():
        ratios = [a / b for a, b in zip(ref.times_ms, r.times_ms)]
        r.speedup_vs_bf16 = statistics.median(ratios) if ratios else ref.ms / r.ms
        r.speedup_vs_bf16_range = interquartile(ratios) if ratios else None
        if r.tokens <= DECODE_MAX_TOKENS:
            r.bytes_bound_vs_bf16 = ref.expert_bytes / r.expert_bytes


def target_for(format_name: str, tokens: int) -> float | None:
    """The issue's speed-up target over the bf16 fused backend for a quantized format at M tokens (None: none)."""
    regime = "decode" if tokens <= DECODE_MAX_TOKENS else "prefill" if tokens >= PREFILL_MIN_TOKENS else None
    if regime is None or format_name not in {f.value for f in QuantFormat}:
        return None
    return TARGETS[regime][QuantFormat(format_name)]


def add_speedups(results: list[LayerResult]) -> None:
    """speedup_vs_naive (over the naive loop of the same format at the same M) and each row's target."""
    naive_ms = {(r.format, r.tokens): r.ms for r in results if r.backend == "naive"}
    for r in results:
        if (r.format, r.tokens) in naive_ms:
            r.speedup_vs_naive = naive_ms[r.format, r.tokens] / r.ms
        r.target_vs_bf16 = target_for(r.format, r.tokens)


def plan_groups(preset: LayerPreset, cases: Sequence[Case], reference: Case | None,
                available: int | None = None) -> list[list[Case]]:
    """Which layers exist at once: all if they fit in MEMORY_SHARE of `available` memory (default: free now),
    else one format at a time, else one case at a time. A group without the reference gets it too, timed only
    for that group's ratios."""
    budget = MEMORY_SHARE * (_available_memory() if available is None else available)
    dtypes = {c.format.dtype for c in cases if c.format.quant is None}
    if any(c.format.quant is not None for c in cases):
        dtypes.add(REFERENCE_DTYPE)  # quantized from bf16 weights
    masters = sum(weights_nbytes(preset, d) for d in dtypes)
    quantized = max((quantized_nbytes(preset, c.format) for c in cases), default=0)  # one format's at a time

    def plan(groups: list[list[Case]]) -> list[list[Case]]:
        return [g if reference is None or reference in g else [*g, reference] for g in groups]

    def fits(groups: list[list[Case]]) -> bool:
        return all(masters + quantized + sum(case_nbytes(preset, c) for c in g) < budget for g in groups)

    formats = list(dict.fromkeys(c.format for c in cases))
    for groups in (plan([list(cases)]), plan([[c for c in cases if c.format == f] for f in formats]),
                   plan([[c] for c in cases])):
        if fits(groups):
            return groups
    return groups


def weights_nbytes(preset: LayerPreset, dtype: torch.dtype) -> int:
    return preset.experts * 3 * preset.hidden * preset.inter * dtype.itemsize


def quantized_nbytes(preset: LayerPreset, fmt: WeightFormat) -> int:
    """About what the layer's QuantizedWeight pair holds (a byte per code, plus scales); 0 for float formats."""
    return 0 if fmt.quant is None else weights_nbytes(preset, torch.int8) * 9 // 8


def case_nbytes(preset: LayerPreset, case: Case) -> int:
    """The memory a case's layer adds: its packed copy. The naive loop runs on the float weights themselves, or on
    a quantized format's weights dequantized to the activations' dtype."""
    if case.backend == "naive":
        return 0 if case.format.quant is None else weights_nbytes(preset, case.format.dtype)
    if case.format.quant is None:
        return weights_nbytes(preset, case.format.dtype)
    f, g, H, I = case.format.quant.value, case.format.group_size, preset.hidden, preset.inter
    blocks13, bytes13 = ops.quant_packed_shape(f, 2 * I, H, g, True)
    blocks2, bytes2 = ops.quant_packed_shape(f, H, I, g, False)
    return preset.experts * (blocks13 * bytes13 + blocks2 * bytes2)


def run_cases(preset: LayerPreset, cases: Sequence[Case], tokens: Sequence[int], machine: MachineInfo,
              reference: Case | None = None, quick: bool = False, seed: int = 0,
              on_case: Callable[[str], None] = lambda what: None) -> Iterator[LayerResult]:
    """Yields one result per (case, M), with speedup_vs_bf16 from `reference` timed in the same repetitions.
    Each format is quantized once, from the bf16 weights, and all its layers pack that one copy. `on_case` hears
    what is about to run (for a progress bar)."""
    groups = plan_groups(preset, cases, reference)
    last_use = {c.format: i for i, g in enumerate(groups) for c in g}
    dtypes = list(dict.fromkeys(c.format.dtype for c in cases))
    pools = {m: {d: [make_inputs(preset, m, d, seed + 1 + i) for i in range(INPUT_POOL)] for d in dtypes}
             for m in tokens}
    probe = ops.ReadBandwidthProbe((256 << 20) if quick else (1 << 30))
    masters: dict[torch.dtype, dict] = {}
    quantized: dict[WeightFormat, dict] = {}

    def weights_for(fmt: WeightFormat) -> dict:
        source = fmt.dtype if fmt.quant is None else REFERENCE_DTYPE
        if source not in masters:
            on_case(f"random {str(source).removeprefix('torch.')} weights")
            masters[source] = make_weights(preset, source, seed)
        if fmt.quant is None:
            return masters[source]
        if fmt not in quantized:
            on_case(f"{fmt.name}: quantizing")
            quantized[fmt] = quantize_weights(masters[source], fmt)
        return quantized[fmt]

    reported: set[tuple[Case, int]] = set()
    for index, group in enumerate(groups):
        layers = {}
        for case in group:
            on_case(f"{case.label}: packing")
            layers[case] = build_layer(preset, weights_for(case.format), case.backend,
                                       None if case.format.quant is None else case.format.dtype)
        for fmt in [f for f in quantized if last_use[f] <= index]:
            del quantized[fmt]   # every layer of this format is built
        for m in tokens:
            on_case(f"M={m}: {', '.join(c.label for c in group)}")
            results = measure_tokens(layers, {c.format.dtype: pools[m][c.format.dtype] for c in group}, probe,
                                     machine, quick)
            compare_with_reference(results, reference)
            for case, result in results.items():
                if (case, m) not in reported:   # the reference joins every group but is reported once
                    reported.add((case, m))
                    yield result
        del layers
        gc.collect()


def _available_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def bench_report(preset: LayerPreset, formats: Sequence[WeightFormat], cases: Sequence[Case],
                 reference: Case | None, unrun: list[dict], machine: MachineInfo, results: list[LayerResult]) -> dict:
    """Everything a run measured, as plain JSON-able data."""
    layer = asdict(preset)
    layer.update(weights_bytes=weights_nbytes(preset, REFERENCE_DTYPE), formats=[
        dict(format=f.name, activations=str(f.dtype).removeprefix("torch."), group_size=f.group_size,
             oracle_choice=oracle_choice(preset, f), backends=[c.backend for c in cases if c.format == f])
        for f in formats])
    layer["reference"] = None if reference is None else dict(format=reference.format.name, backend=reference.backend)
    layer["unrun"] = unrun
    return dict(machine=machine.to_dict(), layer=layer, results=[asdict(r) for r in results])


def oracle_choice(preset: LayerPreset, fmt: WeightFormat) -> str | None:
    """The experts backend the oracle picks for this layer in this format; None when none of them can run it."""
    try:
        return choose_backend(experts_config(preset, fmt)).name
    except ValueError:   # NoSupportedBackend
        return None


def run_layer_bench(preset: LayerPreset, formats: Sequence[WeightFormat] | torch.dtype, tokens: Sequence[int], *,
                    backends: Sequence[str] | None = None, quick: bool = False, machine: MachineInfo | None = None,
                    progress: Console | None = None, seed: int = 0) -> dict:
    """Measures the machine (unless given), runs every (format, backend, M) case and returns bench_report's dict.
    `backends`: only these backends (a format none of them can run is listed under layer.unrun). `progress`: the
    console to draw a progress bar on (None: no bar)."""
    if isinstance(formats, torch.dtype):
        formats = [WeightFormat(formats)]
    formats = list(dict.fromkeys(formats))
    cases, unrun = select_cases(preset, formats, backends)
    reference = reference_case(cases)
    floats = [f.dtype for f in formats if f.quant is None]
    mm_dtype = REFERENCE_DTYPE if REFERENCE_DTYPE in floats or len(floats) < len(formats) else floats[0]
    results: list[LayerResult] = []
    with OtherCpuUse() as other, _progress_bar(progress) as bar:
        task = bar.add_task("measuring the machine", total=len(cases) * len(tokens))
        machine = machine or measure_machine(mm_dtype, quick=quick)
        for result in run_cases(preset, cases, tokens, machine, reference, quick, seed,
                                on_case=lambda what: bar.update(task, description=what)):
            results.append(result)
            bar.advance(task)
    order = [(c.format.name, c.backend) for c in cases]
    results.sort(key=lambda r: (r.tokens, order.index((r.format, r.backend))))
    add_speedups(results)
    report = bench_report(preset, formats, cases, reference, unrun, machine, results)
    report["other_cpu_fraction"] = other.fraction
    return report


def _progress_bar(console: Console | None) -> Progress:
    return Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=console is None, transient=True)


def render_layer_report(report: dict, console: Console) -> None:
    """The run's header (layer, formats, machine), one table of every case grouped by M, and any format no backend
    could run."""
    layer, machine = report["layer"], report["machine"]
    console.print(_layer_line(layer))
    console.print("[bold]formats[/] " + "   ".join(
        f"{f['format']}{_group(f)} -> oracle picks [bold]{f['oracle_choice'] or 'none'}[/]" for f in layer["formats"]))
    console.print(f"[bold]CPU[/] {machine['cpu']}   [bold]features[/] {' '.join(machine['features'])}   "
                  f"[bold]threads[/] {machine['threads']}")
    console.print(f"[bold]read bandwidth[/] {machine['bandwidth_gbs']:.1f} GB/s   [bold]{machine['mm_dtype']} mm peak"
                  f"[/] {machine['mm_gflops']:.0f} GFLOP/s ({machine['mm_size']}^3)   torch {machine['torch_version']}")
    other = report.get("other_cpu_fraction")
    if other is not None and other >= BUSY_FRACTION:
        console.print(f"[yellow]other processes took {100 * other:.0f}% of the CPUs during the run: every figure "
                      "may be low[/]")
    elif other is not None:
        console.print(f"other processes took {100 * other:.0f}% of the CPUs during the run")
    console.print(layer_table(report))
    ref = layer["reference"]
    if ref is None and any(f["format"] != "bfloat16" for f in layer["formats"]):
        console.print("[yellow]no bf16 fused backend measured: add bf16 to --dtype (and its backend to --backends) "
                      "for the vs bf16 column[/]")
    for u in layer["unrun"]:
        console.print(f"[yellow]{u['format']}: no backend could run it[/] (" +
                      "; ".join(f"{name}: {why}" for name, why in u["reasons"].items()) + ")")


def _group(fmt: dict) -> str:
    if fmt["format"] in {f.value for f in QuantFormat}:
        return f" (g{fmt['group_size']})" if fmt["group_size"] else " (per channel)"
    return ""


def _layer_line(layer: dict) -> str:
    expert_mb = layer["weights_bytes"] / layer["experts"] / 1e6
    routing = f"{layer['scoring']} top-{layer['top_k']}" + (", renormalize" if layer["renormalize"] else "")
    shared = f"   (its {layer['shared_experts']} shared expert(s) not included)" if layer["shared_experts"] else ""
    ref = layer["reference"]
    versus = f"   vs bf16 = over [bold]{ref['backend']}[/] bf16" if ref else ""
    return (f"[bold]{layer['name']}[/]  H={layer['hidden']} I={layer['inter']} E={layer['experts']} "
            f"k={layer['top_k']}  {layer['activation']}  {routing}   bf16 weights "
            f"{layer['weights_bytes'] / 1e9:.2f} GB ({expert_mb:.1f} MB/expert){versus}{shared}")


def layer_table(report: dict) -> Table:
    layer = report["layer"]
    table = Table(title=f"{layer['name']} MoE layer (routing included; % of read bandwidth, % of torch.mm and vs bf16 "
                        "measured side by side per M; experts hit, MB per expert as each backend packs it, scales "
                        "included; kernel: % of read bandwidth over the native kernel's own time)",
                  title_justify="left")
    columns = ("M", "experts", "format", "backend", "MB/exp", "ms", "GFLOP/s", "GB/s", "% bw", "kernel", "% mm",
               "vs naive", "vs bf16 (target)", "bytes bound")
    for name in columns:
        table.add_column(name, justify="left" if name in ("format", "backend") else "right", no_wrap=True)
    chosen = {f["format"]: f["oracle_choice"] for f in layer["formats"]}
    results = report["results"]
    order = list(dict.fromkeys((r["format"], r["backend"]) for r in results))
    for m in sorted({r["tokens"] for r in results}):
        group = sorted((r for r in results if r["tokens"] == m), key=lambda r: order.index((r["format"], r["backend"])))
        for i, r in enumerate(group):
            first_of_format = i == 0 or group[i - 1]["format"] != r["format"]
            backend = f"[bold]{r['backend']}[/]" if r["backend"] == chosen.get(r["format"]) else r["backend"]
            table.add_row(str(m) if i == 0 else "", str(r["distinct_experts"]) if i == 0 else "",
                          _short(r["format"]) if first_of_format else "", backend, f"{r['expert_bytes'] / 1e6:.2f}",
                          f"{r['ms']:.3f}", f"{r['gflops']:.1f}", f"{r['gbs']:.1f}", _percent(r),
                          _kernel_percent(r), f"{r['peak_pct']:.0f}%", _ratio(r["speedup_vs_naive"]), _versus_bf16(r),
                          _ratio(r["bytes_bound_vs_bf16"]), end_section=i == len(group) - 1)
    return table


def _short(name: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(name, name)


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _percent(r: dict) -> str:
    """% of the probe, with the repetitions' interquartile range where there is one."""
    spread = r.get("bandwidth_pct_range")
    return f"{r['bandwidth_pct']:.0f}%" + (f" ({spread[0]:.0f}-{spread[1]:.0f})" if spread else "")


def _kernel_percent(r: dict) -> str:
    value = r.get("kernel_bandwidth_pct")
    return "" if value is None else f"{value:.0f}%"


def _versus_bf16(r: dict) -> str:
    speedup, target = r["speedup_vs_bf16"], r["target_vs_bf16"]
    if speedup is None:
        return "" if target is None else f"- (>= {target:.1f}x)"
    spread = r.get("speedup_vs_bf16_range")
    shown = spread is not None and tuple(spread) != (speedup, speedup)   # not the reference's own 1.00-1.00
    text = f"{speedup:.2f}x" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if shown else "")
    if target is None:
        return text
    color = "green" if speedup >= target else "red"
    return f"[{color}]{text}[/] (>= {target:.1f}x)"
