"""`cpumoe bench throughput`: the offline engine under a serving load, one step budget against another.

    num_prompts random prompts, all there at the start, at most max_concurrency in flight (a new one as soon as one
    finishes: `vllm bench serve --request-rate inf --max-concurrency C` without the HTTP) -> LLMEngine.step() ...

Every --max-num-batched-tokens value runs the same prompts, in turn within each repetition (the machine drifts), with
prefix caching off so no run reuses another's prompts. Beside output tok/s, TTFT and TPOT (as `vllm bench serve`
defines them), each run is taken apart by what its steps ran: steps of decodes only, and steps that carried a prompt
chunk (with how many decodes rode along). Their counts and times are the account of where a load's time goes: with
MoE a step that carries a chunk reads nearly every expert, so it costs far more than the decodes it carries.

And each run beside its bound: every step's floor (WeightBytes.step_floor_s: its weights' bytes at the read probe, the
experts its tokens chose counted, or their FLOPs at the probe's GEMM rate where that is longer; the KV cache's bytes)
summed over the run's steps, and the output rate the run would give with every step at its floor. The probes are
taken right before and after each run, as `bench model` takes them around a case.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from cpumoe.bench.model import (FLOAT_FORMATS, MM_SIZE, QUICK_MM_SIZE, ExpertCounter, MachineLimits, ModelCase,
                                WeightBytes, random_prompts, weight_bytes, weights_format)
from cpumoe.engine.api import SamplingParams
from cpumoe.engine.engine import LLMEngine


@dataclass(frozen=True, slots=True)
class Load:
    num_prompts: int = 32
    max_concurrency: int = 16
    input_len: int = 512
    output_len: int = 128
    temperature: float = 1.0   # `vllm bench serve`'s default sampling
    seed: int = 0


@dataclass(slots=True)
class StepGroup:
    """Steps of one kind in a run: how many, their median and total time, the decodes they carried, and the sum of
    their floors (step_floor_s)."""
    steps: int = 0
    median_ms: float = 0.0
    total_s: float = 0.0
    decodes: int = 0
    prefill_tokens: int = 0
    floor_s: float = 0.0


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step ran, for its floor: tokens, the ones that got logits, keys read, experts chosen per MoE layer."""
    tokens: int
    sampled: int
    kv_tokens: int
    experts_per_layer: float | None


@dataclass(slots=True)
class ThroughputResult:
    max_num_batched_tokens: int
    repeat: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    total_tok_s: float
    mean_ttft_ms: float
    median_ttft_ms: float
    mean_tpot_ms: float
    steps: int
    decode_steps: StepGroup = field(default_factory=StepGroup)    # steps of decodes only
    prefill_steps: StepGroup = field(default_factory=StepGroup)   # steps that carried a prompt chunk
    bandwidth_gbs: float = 0.0        # the mean of the read probes right before and after the run
    gemm_gflops: float | None = None  # the GEMM probe before it (None: not counted, quantized weights)

    @property
    def bound_tok_s(self) -> float:
        """The output rate with every step at its floor."""
        floor = self.decode_steps.floor_s + self.prefill_steps.floor_s
        return self.output_tokens / floor if floor > 0 else float("nan")


def load_case(load: Load) -> ModelCase:
    """The load as bench model's case: every prompt at once (what engine_config sizes the KV cache for)."""
    return ModelCase(load.num_prompts, load.input_len, load.output_len)


@dataclass(frozen=True, slots=True)
class FloorProbes:
    """What a run's step floors need: the model's bytes and FLOPs, and the probes to take around the run."""
    weights: WeightBytes
    limits: MachineLimits
    count_gemm: bool   # False where the mm probe's rate is not the weights' (quantized formats): bytes only

    @classmethod
    def of(cls, engine: LLMEngine, quick: bool = False) -> "FloorProbes":
        """quick: a 256 MiB read probe and a 1024^3 mm instead of 1 GiB and 4096^3 (tests, smoke runs)."""
        limits = MachineLimits(probe_bytes=(256 << 20) if quick else (1 << 30),
                               mm_size=QUICK_MM_SIZE if quick else MM_SIZE, dtype=engine.dtype)
        return cls(weight_bytes(engine), limits, weights_format(engine) in FLOAT_FORMATS)

    def before(self) -> tuple[float, float | None]:
        """(read GB/s, GEMM GFLOP/s or None) right before a run."""
        if not self.count_gemm:
            return self.limits.measure_bandwidth(), None
        return self.limits.measure()

    def floor_s(self, shape: StepShape, bandwidth_gbs: float, gemm_gflops: float | None) -> float:
        return self.weights.step_floor_s(shape.tokens, shape.sampled, shape.kv_tokens, shape.experts_per_layer,
                                         bandwidth_gbs, gemm_gflops)


def _group(times: list[float], decodes: int, prefill_tokens: int, floors: list[float]) -> StepGroup:
    if not times:
        return StepGroup()
    return StepGroup(len(times), 1000 * statistics.median(times), sum(times), decodes, prefill_tokens, sum(floors))


def run_load(engine: LLMEngine, prompts: list[list[int]], load: Load, budget: int, repeat: int = 0,
             probes: FloorProbes | None = None) -> ThroughputResult:
    """One run of the load at a step budget of `budget` tokens. The engine must be idle. probes: for the steps'
    floors, taken around the run (None: no floors)."""
    if engine.has_unfinished():
        raise RuntimeError("run_load needs an idle engine")
    engine.config.max_num_batched_tokens = budget   # the scheduler reads it each step
    params = SamplingParams(max_tokens=load.output_len, temperature=load.temperature, ignore_eos=True)
    bandwidth, gemm = probes.before() if probes is not None else (0.0, None)
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    decode_times, prefill_times = [], []
    decode_shapes: list[StepShape] = []
    prefill_shapes: list[StepShape] = []
    riding = prefill_tokens = decode_only_decodes = 0
    next_prompt = in_flight = done = tokens = 0
    with ExpertCounter(engine.model) as counter:
        counter.counting = probes is not None   # the experts a step chose, for its floor
        start = time.perf_counter()
        while done < len(prompts):
            while in_flight < load.max_concurrency and next_prompt < len(prompts):
                request_id = f"{repeat}-{budget}-{next_prompt}"
                engine.add_request(request_id, prompts[next_prompt], params)
                arrival[request_id] = time.perf_counter()   # sent when a slot frees, as vllm bench serve times it
                next_prompt += 1
                in_flight += 1
            t0 = time.perf_counter()
            outputs = engine.step()
            t1 = time.perf_counter()
            batch = engine.last_batch   # this step's (empty when it scheduled nothing)
            # the lm_head runs at least for the decodes (chunks that end their prompt too: left out, so a floor)
            shape = StepShape(batch.num_tokens, batch.num_decodes,
                              sum(seq.num_computed_tokens for seq in batch.seqs), counter.take())
            if batch.num_tokens > batch.num_decode_tokens:
                prefill_times.append(t1 - t0)
                prefill_shapes.append(shape)
                riding += batch.num_decodes
                prefill_tokens += batch.num_tokens - batch.num_decode_tokens
            elif batch.seqs:
                decode_times.append(t1 - t0)
                decode_shapes.append(shape)
                decode_only_decodes += batch.num_decodes
            for out in outputs:
                if out.new_token_ids:
                    tokens += len(out.new_token_ids)
                    first.setdefault(out.request_id, t1)
                    last[out.request_id] = t1
                if out.finished:
                    done += 1
                    in_flight -= 1
        duration = time.perf_counter() - start
    if probes is not None:
        bandwidth = (bandwidth + probes.limits.measure_bandwidth()) / 2

    def floors(shapes: list[StepShape]) -> list[float]:
        return [] if probes is None else [probes.floor_s(shape, bandwidth, gemm) for shape in shapes]

    ttft = [1000 * (first[r] - arrival[r]) for r in first]
    tpot = [1000 * (last[r] - first[r]) / (load.output_len - 1) for r in first if load.output_len > 1]
    return ThroughputResult(
        max_num_batched_tokens=budget, repeat=repeat, duration_s=duration, output_tokens=tokens,
        output_tok_s=tokens / duration, total_tok_s=(tokens + len(prompts) * load.input_len) / duration,
        mean_ttft_ms=statistics.mean(ttft), median_ttft_ms=statistics.median(ttft),
        mean_tpot_ms=statistics.mean(tpot) if tpot else 0.0, steps=len(decode_times) + len(prefill_times),
        decode_steps=_group(decode_times, decode_only_decodes, 0, floors(decode_shapes)),
        prefill_steps=_group(prefill_times, riding, prefill_tokens, floors(prefill_shapes)),
        bandwidth_gbs=bandwidth, gemm_gflops=gemm)


def run_throughput_bench(engine: LLMEngine, load: Load, budgets: list[int], repeats: int = 1,
                         on_result=None, quick: bool = False) -> list[ThroughputResult]:
    """Every budget once per repetition, in turn, on the same prompts. quick: smaller probes (a 256 MiB read, a
    1024^3 mm) for the floors."""
    prompts = random_prompts(engine, load_case(load), load.seed)
    probes = FloorProbes.of(engine, quick)
    results = []
    for repeat in range(repeats):
        for budget in budgets:
            result = run_load(engine, prompts, load, budget, repeat, probes)
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


def render_throughput_report(results: list[ThroughputResult], load: Load, title: str):
    """A rich Table: a row per run, budgets in turn, and each budget's output rate over its repetitions."""
    from rich.table import Table

    table = Table(title=f"{title}: {load.num_prompts} random prompts of {load.input_len} tokens, {load.output_len} "
                        f"out, {load.max_concurrency} at a time, temperature {load.temperature:g}")
    for name in ("budget", "run", "output tok/s", "mean TTFT ms", "mean TPOT ms", "steps",
                 "decode steps: n (median ms, s)", "chunk steps: n (median ms, s)", "decodes riding",
                 "floors s: decode + chunk", "bound tok/s (% of it)"):
        table.add_column(name, justify="right")
    by_budget: dict[int, list[float]] = {}
    for r in results:
        by_budget.setdefault(r.max_num_batched_tokens, []).append(r.output_tok_s)
    for r in sorted(results, key=lambda r: (r.max_num_batched_tokens, r.repeat)):
        d, p = r.decode_steps, r.prefill_steps
        table.add_row(str(r.max_num_batched_tokens), str(r.repeat + 1), f"{r.output_tok_s:.1f}",
                      f"{r.mean_ttft_ms:.0f}", f"{r.mean_tpot_ms:.1f}", str(r.steps),
                      f"{d.steps} ({d.median_ms:.0f}, {d.total_s:.1f})", f"{p.steps} ({p.median_ms:.0f}, {p.total_s:.1f})",
                      f"{p.decodes} of {r.output_tokens}", f"{d.floor_s:.1f} + {p.floor_s:.1f}",
                      f"{r.bound_tok_s:.1f} ({100 * r.output_tok_s / r.bound_tok_s:.0f}%)")
    rates = {b: statistics.median(v) for b, v in by_budget.items()}
    best = max(rates, key=rates.get)
    ranges = "; ".join(f"{b}: {min(v):.1f}-{max(v):.1f}" if len(v) > 1 else f"{b}: {v[0]:.1f}"
                       for b, v in sorted(by_budget.items()))
    probes = "; ".join(f"{r.bandwidth_gbs:.1f} GB/s" + (f", {r.gemm_gflops:.0f} GFLOP/s" if r.gemm_gflops else "")
                       for r in results)
    caption = (f"output tok/s by budget ({ranges}); the highest median: {best} tokens a step. A chunk step reads "
               "nearly every expert; decodes riding on it skip a step of their own. Floors: each step's weight "
               "bytes (the experts its tokens chose) and KV bytes at the read probe, or its FLOPs at the GEMM "
               "probe where longer, summed over the run's steps; bound: the output rate with every step at its "
               f"floor (probes, run by run: {probes}).")
    table.caption = caption
    return table
