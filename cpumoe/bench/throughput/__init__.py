"""`cpumoe bench throughput`: the offline engine under a serving load, one step budget against another.

    num_prompts random prompts, all there at the start, at most max_concurrency in flight (a new one as soon as one
    finishes: `vllm bench serve --request-rate inf --max-concurrency C` without the HTTP) -> LLMEngine.step() ...

Every --max-num-batched-tokens value runs the same prompts, in turn within each repetition (the machine drifts), with
prefix caching off so no run reuses another's prompts. Beside output tok/s, TTFT and TPOT (as `vllm bench serve`
defines them), each run is taken apart by what its steps ran: steps of decodes only, and steps that carried a prompt
chunk (with how many decodes rode along). Their counts and times are the account of where a load's time goes: with
MoE a step that carries a chunk reads nearly every expert, so it costs far more than the decodes it carries.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from cpumoe.bench.model import ModelCase, random_prompts
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
    """Steps of one kind in a run: how many, their median and total time, the decodes they carried."""
    steps: int = 0
    median_ms: float = 0.0
    total_s: float = 0.0
    decodes: int = 0
    prefill_tokens: int = 0


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


def load_case(load: Load) -> ModelCase:
    """The load as bench model's case: every prompt at once (what engine_config sizes the KV cache for)."""
    return ModelCase(load.num_prompts, load.input_len, load.output_len)


def _group(times: list[float], decodes: int, prefill_tokens: int) -> StepGroup:
    if not times:
        return StepGroup()
    return StepGroup(len(times), 1000 * statistics.median(times), sum(times), decodes, prefill_tokens)


def run_load(engine: LLMEngine, prompts: list[list[int]], load: Load, budget: int, repeat: int = 0) -> ThroughputResult:
    """One run of the load at a step budget of `budget` tokens. The engine must be idle."""
    if engine.has_unfinished():
        raise RuntimeError("run_load needs an idle engine")
    engine.config.max_num_batched_tokens = budget   # the scheduler reads it each step
    params = SamplingParams(max_tokens=load.output_len, temperature=load.temperature, ignore_eos=True)
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    decode_times, prefill_times = [], []
    riding = prefill_tokens = decode_only_decodes = 0
    next_prompt = in_flight = done = tokens = 0
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
        if batch.num_tokens > batch.num_decode_tokens:
            prefill_times.append(t1 - t0)
            riding += batch.num_decodes
            prefill_tokens += batch.num_tokens - batch.num_decode_tokens
        elif batch.seqs:
            decode_times.append(t1 - t0)
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
    ttft = [1000 * (first[r] - arrival[r]) for r in first]
    tpot = [1000 * (last[r] - first[r]) / (load.output_len - 1) for r in first if load.output_len > 1]
    return ThroughputResult(
        max_num_batched_tokens=budget, repeat=repeat, duration_s=duration, output_tokens=tokens,
        output_tok_s=tokens / duration, total_tok_s=(tokens + len(prompts) * load.input_len) / duration,
        mean_ttft_ms=statistics.mean(ttft), median_ttft_ms=statistics.median(ttft),
        mean_tpot_ms=statistics.mean(tpot) if tpot else 0.0, steps=len(decode_times) + len(prefill_times),
        decode_steps=_group(decode_times, decode_only_decodes, 0),
        prefill_steps=_group(prefill_times, riding, prefill_tokens))


def run_throughput_bench(engine: LLMEngine, load: Load, budgets: list[int], repeats: int = 1,
                         on_result=None) -> list[ThroughputResult]:
    """Every budget once per repetition, in turn, on the same prompts."""
    prompts = random_prompts(engine, load_case(load), load.seed)
    results = []
    for repeat in range(repeats):
        for budget in budgets:
            result = run_load(engine, prompts, load, budget, repeat)
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
                 "decode steps: n (median ms, s)", "chunk steps: n (median ms, s)", "decodes riding"):
        table.add_column(name, justify="right")
    by_budget: dict[int, list[float]] = {}
    for r in results:
        by_budget.setdefault(r.max_num_batched_tokens, []).append(r.output_tok_s)
    for r in sorted(results, key=lambda r: (r.max_num_batched_tokens, r.repeat)):
        d, p = r.decode_steps, r.prefill_steps
        table.add_row(str(r.max_num_batched_tokens), str(r.repeat + 1), f"{r.output_tok_s:.1f}",
                      f"{r.mean_ttft_ms:.0f}", f"{r.mean_tpot_ms:.1f}", str(r.steps),
                      f"{d.steps} ({d.median_ms:.0f}, {d.total_s:.1f})", f"{p.steps} ({p.median_ms:.0f}, {p.total_s:.1f})",
                      f"{p.decodes} of {r.output_tokens}")
    rates = {b: statistics.median(v) for b, v in by_budget.items()}
    best = max(rates, key=rates.get)
    ranges = "; ".join(f"{b}: {min(v):.1f}-{max(v):.1f}" if len(v) > 1 else f"{b}: {v[0]:.1f}"
                       for b, v in sorted(by_budget.items()))
    caption = (f"output tok/s by budget ({ranges}); the highest median: {best} tokens a step. A chunk step reads "
               "nearly every expert; decodes riding on it skip a step of their own.")
    table.caption = caption
    return table
