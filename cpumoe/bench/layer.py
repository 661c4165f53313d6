"""The MoE layer benchmark: one layer shape, every experts path this CPU can run, a list of token counts.

    random weights (seeded, once) -> per path: FusedMoE(backend=path) -> per M: time layer(hidden, router_logits)
                                  -> GFLOP/s, GB/s of the distinct experts touched, vs the machine's limits and naive

The timed call includes routing (select_experts), as a model's forward does. Shared experts are not part of the
layer (FusedMoE runs the routed experts only).

Side by side: this machine is shared and its memory bandwidth drifts by tens of percent over minutes, so the
paths are measured repetition by repetition in turn, and each repetition starts with a streaming read of a
1 GiB buffer (the bandwidth probe) that is also timed: "% bandwidth" compares a path with the probe's median
over the same repetitions. The probe also evicts the caches, and repetitions rotate over INPUT_POOL inputs with
different routing, so no call finds its experts in the last-level cache (a model runs other layers between two
calls of this one). For compute-bound cases (M >= MM_FROM_TOKENS) a torch.mm of mm_size^3 joins each
repetition and "% mm peak" compares with its median. Each path packs its own copy of the weights; when all the
copies would not fit in memory, paths run one after the other instead.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cpumoe import ops
from cpumoe.bench.machine import MachineInfo, OtherCpuUse, measure_machine
from cpumoe.experts import ExpertsConfig, all_paths, choose_path
from cpumoe.layer import FusedMoE
from cpumoe.presets import LayerPreset
from cpumoe.routing import select_experts

TARGET_S = 0.75       # time each case for about this long
MIN_REPS = 3
MAX_REPS = 30
INPUT_POOL = 4        # inputs with different routing, rotated over the repetitions
MM_FROM_TOKENS = 256  # from this M on, a torch.mm joins each repetition as the side-by-side GEMM peak
MEMORY_SHARE = 0.6    # build every path's layer at once only if their weights fit in this share of free memory
SLOW_CALL_S = 2.0     # a call this slow (a slow path at large M) gets only SLOW_REPS repetitions
SLOW_REPS = 2
QUICK_TARGET_S = 0.05  # --quick: one warm-up, then up to QUICK_MAX_REPS calls within about this long
QUICK_MAX_REPS = 3
BUSY_FRACTION = 0.05  # warn when other processes took this share of the CPUs during the run


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
    path: str
    tokens: int
    ms: float                    # median per call
    repetitions: int
    distinct_experts: int
    gflops: float
    gbs: float
    bandwidth_gbs: float         # the bandwidth probe's median over this case's repetitions
    bandwidth_pct: float         # gbs / bandwidth_gbs
    mm_gflops: float             # torch.mm's median over the repetitions (M >= MM_FROM_TOKENS), else the run's
    peak_pct: float              # gflops / mm_gflops
    speedup_vs_naive: float | None = None


@dataclass(slots=True)
class LayerInputs:
    case: LayerCase
    hidden_states: torch.Tensor  # [M, H]
    router_logits: torch.Tensor  # [M, E]


def experts_config(preset: LayerPreset, dtype: torch.dtype) -> ExpertsConfig:
    return ExpertsConfig(hidden_size=preset.hidden, inter_size=preset.inter, num_experts=preset.experts,
                         top_k=preset.top_k, dtype=dtype, activation=preset.activation, has_bias=preset.bias,
                         apply_router_weight_on_input=preset.router_weight_on_input)


def select_paths(config: ExpertsConfig, names: Sequence[str] | None = None) -> list[str]:
    """Every path that supports `config`, fastest first; or the named ones (ValueError if unknown/unsupported)."""
    report = {p.name: p.is_supported(config) for p in all_paths()}
    if names is None:
        return [name for name, (ok, _) in report.items() if ok]
    for name in names:
        if name not in report:
            raise ValueError(f"unknown path {name!r}; known: {', '.join(report)}")
        ok, why = report[name]
        if not ok:
            raise ValueError(f"path {name!r} cannot run this layer: {why}")
    return [name for name in report if name in names]


def make_weights(preset: LayerPreset, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Random w13 [E, 2I, H], w2 [E, H, I] (and biases) scaled by 1/sqrt(fan_in), made directly in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    E, H, I = preset.experts, preset.hidden, preset.inter
    w13 = torch.randn(E, 2 * I, H, generator=g, dtype=dtype).mul_(H**-0.5)  # [E, 2I, H]
    w2 = torch.randn(E, H, I, generator=g, dtype=dtype).mul_(I**-0.5)       # [E, H, I]
    w13_bias = torch.randn(E, 2 * I, generator=g, dtype=dtype).mul_(H**-0.5) if preset.bias else None
    w2_bias = torch.randn(E, H, generator=g, dtype=dtype).mul_(I**-0.5) if preset.bias else None
    return dict(w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias)


def make_inputs(preset: LayerPreset, tokens: int, dtype: torch.dtype, seed: int = 1) -> LayerInputs:
    g = torch.Generator().manual_seed(seed * 100_003 + tokens)
    hidden_states = torch.randn(tokens, preset.hidden, generator=g).to(dtype)      # [M, H]
    router_logits = torch.randn(tokens, preset.experts, generator=g).to(dtype)     # [M, E]
    _, topk_ids = select_experts(router_logits, preset.top_k, scoring=preset.router_scoring,
                                 renormalize=preset.renormalize)                   # [M, k]
    case = LayerCase(hidden=preset.hidden, inter=preset.inter, experts=preset.experts, top_k=preset.top_k,
                     tokens=tokens, dtype=dtype, distinct_experts=int(torch.unique(topk_ids).numel()))
    return LayerInputs(case, hidden_states, router_logits)


def build_layer(preset: LayerPreset, weights: dict[str, torch.Tensor | None], path: str) -> FusedMoE:
    return FusedMoE(weights["w13"], weights["w2"], w13_bias=weights["w13_bias"], w2_bias=weights["w2_bias"],
                    top_k=preset.top_k, activation=preset.activation, scoring=preset.router_scoring,
                    renormalize=preset.renormalize, apply_router_weight_on_input=preset.router_weight_on_input,
                    backend=path)


def repetitions_for(estimate: float, quick: bool) -> int:
    """How many timed calls a path gets, from one call's duration."""
    if quick:
        return min(QUICK_MAX_REPS, max(1, math.ceil(QUICK_TARGET_S / max(estimate, 1e-9))))
    if estimate >= SLOW_CALL_S:
        return SLOW_REPS
    return min(MAX_REPS, max(MIN_REPS, math.ceil(TARGET_S / max(estimate, 1e-9))))


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_tokens(layers: dict[str, FusedMoE], pool: list[LayerInputs], probe, machine: MachineInfo,
                   quick: bool = False) -> list[LayerResult]:
    """One M, every layer in `layers`, interleaved repetition by repetition with the bandwidth probe (and mm)."""
    call = {path: (lambda inputs, layer=layer: layer(inputs.hidden_states, inputs.router_logits))
            for path, layer in layers.items()}
    tokens = pool[0].case.tokens
    with torch.inference_mode():
        reps = {path: repetitions_for(_timed(lambda: fn(pool[0])), quick) for path, fn in call.items()}
        mm = _mm_call(machine) if tokens >= MM_FROM_TOKENS else None
        times: dict[str, list[float]] = {path: [] for path in call}
        bandwidth, mm_seconds = [], []
        for rep in range(max(reps.values())):
            bandwidth.append(probe.read_gbps())
            if mm is not None:
                mm_seconds.append(_timed(mm))
            inputs = pool[rep % len(pool)]
            for path, fn in call.items():
                if rep < reps[path]:
                    times[path].append(_timed(lambda: fn(inputs)))
    gbps = statistics.median(bandwidth)
    mm_gflops = (2 * machine.mm_size**3 / statistics.median(mm_seconds) / 1e9) if mm_seconds else machine.mm_gflops
    distinct = statistics.mean(i.case.distinct_experts for i in pool)
    case = dataclasses.replace(pool[0].case, distinct_experts=round(distinct))
    results = []
    for path, ts in times.items():
        seconds = statistics.median(ts)
        gflops = case.flops() / seconds / 1e9
        gbs = distinct * case.expert_bytes() / seconds / 1e9
        results.append(LayerResult(
            path=path, tokens=tokens, ms=seconds * 1e3, repetitions=len(ts), distinct_experts=case.distinct_experts,
            gflops=gflops, gbs=gbs, bandwidth_gbs=gbps, bandwidth_pct=100 * gbs / gbps, mm_gflops=mm_gflops,
            peak_pct=100 * gflops / mm_gflops))
    return results


def _mm_call(machine: MachineInfo) -> Callable[[], object]:
    dtype = getattr(torch, machine.mm_dtype)
    a = torch.randn(machine.mm_size, machine.mm_size).to(dtype)
    b = torch.randn(machine.mm_size, machine.mm_size).to(dtype)
    return lambda: torch.mm(a, b)


def add_speedups(results: list[LayerResult]) -> None:
    naive_ms = {r.tokens: r.ms for r in results if r.path == "naive"}
    for r in results:
        if r.tokens in naive_ms:
            r.speedup_vs_naive = naive_ms[r.tokens] / r.ms


def run_cases(preset: LayerPreset, dtype: torch.dtype, tokens: Sequence[int], paths: Sequence[str],
              machine: MachineInfo, quick: bool = False, seed: int = 0,
              on_case: Callable[[str], None] = lambda what: None) -> Iterator[LayerResult]:
    """Yields one result per (path, M). All paths side by side when their packed weights fit in memory, else
    one path after another. `on_case` hears what is about to run (for a progress bar)."""
    on_case("random weights")
    weights = make_weights(preset, dtype, seed)
    pools = {m: [make_inputs(preset, m, dtype, seed + 1 + i) for i in range(INPUT_POOL)] for m in tokens}
    probe = ops.ReadBandwidthProbe((256 << 20) if quick else (1 << 30))
    together = (len(paths) + 1) * weights_nbytes(preset, dtype) < MEMORY_SHARE * _available_memory()
    for group in ([list(paths)] if together else [[p] for p in paths]):
        layers = {}
        for path in group:
            on_case(f"{path}: packing weights")
            layers[path] = build_layer(preset, weights, path)
        for m in tokens:
            on_case(f"M={m}: {', '.join(group)}")
            yield from measure_tokens(layers, pools[m], probe, machine, quick)
        del layers
        gc.collect()


def _available_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def weights_nbytes(preset: LayerPreset, dtype: torch.dtype) -> int:
    return preset.experts * 3 * preset.hidden * preset.inter * dtype.itemsize


def bench_report(preset: LayerPreset, dtype: torch.dtype, machine: MachineInfo, chosen: str,
                 results: list[LayerResult]) -> dict:
    """Everything a run measured, as plain JSON-able data."""
    layer = asdict(preset)
    layer.update(dtype=str(dtype).removeprefix("torch."), weights_bytes=weights_nbytes(preset, dtype),
                 oracle_choice=chosen)
    return dict(machine=machine.to_dict(), layer=layer, results=[asdict(r) for r in results])


def run_layer_bench(preset: LayerPreset, dtype: torch.dtype, tokens: Sequence[int], *,
                    paths: Sequence[str] | None = None, quick: bool = False, machine: MachineInfo | None = None,
                    progress: Console | None = None, seed: int = 0) -> dict:
    """Measures the machine (unless given), runs every (path, M) case and returns bench_report's dict.
    `progress`: the console to draw a progress bar on (None: no bar)."""
    config = experts_config(preset, dtype)
    names = select_paths(config, paths)
    chosen = choose_path(config).name
    results: list[LayerResult] = []
    with OtherCpuUse() as other, _progress_bar(progress) as bar:
        task = bar.add_task("measuring the machine", total=len(names) * len(tokens))
        machine = machine or measure_machine(dtype, quick=quick)
        for result in run_cases(preset, dtype, tokens, names, machine, quick, seed,
                                on_case=lambda what: bar.update(task, description=what)):
            results.append(result)
            bar.advance(task)
    results.sort(key=lambda r: (r.tokens, names.index(r.path)))
    add_speedups(results)
    report = bench_report(preset, dtype, machine, chosen, results)
    report["other_cpu_fraction"] = other.fraction
    return report


def _progress_bar(console: Console | None) -> Progress:
    return Progress(TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=console is None, transient=True)


def render_layer_report(report: dict, console: Console) -> None:
    """The run's header (layer, machine) and one table of every case, grouped by M."""
    layer, machine = report["layer"], report["machine"]
    console.print(_layer_line(layer))
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


def _layer_line(layer: dict) -> str:
    expert_mb = layer["weights_bytes"] / layer["experts"] / 1e6
    routing = f"{layer['scoring']} top-{layer['top_k']}" + (", renormalize" if layer["renormalize"] else "")
    shared = f"   (its {layer['shared_experts']} shared expert(s) not included)" if layer["shared_experts"] else ""
    return (f"[bold]{layer['name']}[/]  H={layer['hidden']} I={layer['inter']} E={layer['experts']} "
            f"k={layer['top_k']}  {layer['dtype']}  {layer['activation']}  {routing}   weights "
            f"{layer['weights_bytes'] / 1e9:.2f} GB ({expert_mb:.1f} MB/expert)   oracle picks "
            f"[bold]{layer['oracle_choice']}[/]{shared}")


def layer_table(report: dict) -> Table:
    layer = report["layer"]
    table = Table(title=f"{layer['name']} MoE layer, {layer['dtype']} (routing included; % of bandwidth and mm "
                        "measured side by side per M)", title_justify="left")
    for name in ("M", "experts hit", "path", "ms", "GFLOP/s", "GB/s", "% bandwidth", "% mm peak", "vs naive"):
        table.add_column(name, justify="left" if name == "path" else "right", no_wrap=True)
    results = report["results"]
    path_order = list(dict.fromkeys(r["path"] for r in results))
    for m in sorted({r["tokens"] for r in results}):
        group = sorted((r for r in results if r["tokens"] == m), key=lambda r: path_order.index(r["path"]))
        for i, r in enumerate(group):
            speedup = r["speedup_vs_naive"]
            path = f"[bold]{r['path']}[/]" if r["path"] == layer["oracle_choice"] else r["path"]
            table.add_row(str(m) if i == 0 else "", str(r["distinct_experts"]) if i == 0 else "", path,
                          f"{r['ms']:.3f}", f"{r['gflops']:.1f}", f"{r['gbs']:.1f}", f"{r['bandwidth_pct']:.0f}%",
                          f"{r['peak_pct']:.0f}%", "" if speedup is None else f"{speedup:.2f}x",
                          end_section=i == len(group) - 1)
    return table
