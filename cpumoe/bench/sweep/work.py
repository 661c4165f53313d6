"""Runs one unit of a sweep in this process (the driver's, or a Ray worker's) and yields one Outcome per case.

    memory check (cpumoe.bench.sweep.memory) -> too large: an "oom" outcome per case, nothing run
    layer: cpumoe.bench.layer's select_cases -> run_cases (quick timing by default) -> an "ok" outcome per M
    model: [synthetic: make_checkpoint in a temporary directory] -> LLMEngine -> cpumoe.bench.model's run_case
           (a warm-up, then `repeats` runs, the median by end-to-end time) -> an "ok" outcome per run
    a case that raises: an "error" outcome with the message, for it and the unit's cases not yet run

Every outcome carries the read bandwidth and GEMM rate its percentages are of, and the facts of the machine it ran on
(a Ray worker's own), so the driver writes rows as if it had run them.
"""
from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from cpumoe.bench.sweep.cases import LayerUnit, ModelUnit, SyntheticModel
from cpumoe.bench.sweep.memory import MemoryPolicy
from cpumoe.bench.sweep.rows import layer_metrics, model_metrics


@dataclass(slots=True)
class Outcome:
    bench: str
    case: dict[str, Any]
    status: str                         # "ok", "oom", "error"
    metrics: dict[str, Any]
    bandwidth_gbs: float | None = None
    mm_gflops: float | None = None
    machine_facts: dict[str, Any] = field(default_factory=dict)


_machines: dict[tuple, Any] = {}   # this process's machine measurement, per (threads, dtype): taken once


def machine_info(threads: int, dtype):
    """This process's quick measurement of the machine on `threads` threads (which it leaves torch set to)."""
    import torch

    from cpumoe.bench.machine import measure_machine

    torch.set_num_threads(threads)
    key = (threads, dtype)
    if key not in _machines:
        _machines[key] = measure_machine(dtype, quick=True)
    return _machines[key]


def execute(unit: LayerUnit | ModelUnit, policy: MemoryPolicy = MemoryPolicy(),
            on_case: Callable[[str], None] = lambda what: None) -> Iterator[Outcome]:
    """Every case of `unit`, in order: oom (not run), ok, or error. Never raises for a case's failure. `on_case`
    hears what is about to run (a progress bar's description)."""
    import torch

    from cpumoe.bench.results import machine_facts

    facts = machine_facts()
    budget, free = policy.budget()
    need = unit.bytes_needed()
    if need > budget:
        for case in unit.cases():
            yield Outcome(unit.bench, case, "oom", dict(bytes_needed=need, bytes_available=free,
                                                        bytes_budget=budget), machine_facts=facts)
        return
    torch.set_num_threads(unit.threads)
    pending = unit.cases()
    runner = _run_layer(unit, on_case) if isinstance(unit, LayerUnit) else _run_model(unit, on_case)
    try:
        for outcome in runner:
            outcome.machine_facts = facts
            pending = [c for c in pending if c != outcome.case]
            yield outcome
    except Exception as e:   # any failure of a case: recorded, and the sweep goes on
        message = f"{type(e).__name__}: {e}"
        for case in pending:
            yield Outcome(unit.bench, case, "error", dict(message=message), machine_facts=facts)
    finally:
        runner.close()
        gc.collect()


def _run_layer(unit: LayerUnit, on_case: Callable[[str], None]) -> Iterator[Outcome]:
    from cpumoe.bench import layer as lb

    if unit.backend == "none":
        raise ValueError(f"no experts backend can run this layer: {unit.refusal}")
    preset = unit.preset
    fmt = lb.parse_weight_format(unit.format, unit.group_size)
    cases, _ = lb.select_cases(preset, [fmt], [unit.backend])
    machine = machine_info(unit.threads, fmt.dtype)
    by_tokens = {c["tokens"]: c for c in unit.cases()}
    for result in lb.run_cases(preset, cases, unit.tokens, machine, lb.reference_case(cases), quick=unit.quick,
                               on_case=lambda what: on_case(f"{unit.label}: {what}")):
        # Quick timing takes one to three probe reads beside a case, and one read slowed by anything else on the
        # machine put cases at 150-340% of "the limit". The limit is the better of those reads and the
        # machine's own measurement (best of three) at the start of the run.
        bandwidth = max(result.bandwidth_gbs, machine.bandwidth_gbs)
        mm_gflops = max(result.mm_gflops, machine.mm_gflops)
        r = asdict(result) | dict(bandwidth_gbs=bandwidth, bandwidth_pct=100 * result.gbs / bandwidth,
                                  mm_gflops=mm_gflops, peak_pct=100 * result.gflops / mm_gflops)
        yield Outcome("layer", by_tokens[result.tokens], "ok",
                      layer_metrics(r, hidden=preset.hidden, inter=preset.inter, top_k=preset.top_k),
                      bandwidth_gbs=bandwidth, mm_gflops=mm_gflops)


def _run_model(unit: ModelUnit, on_case: Callable[[str], None]) -> Iterator[Outcome]:
    if isinstance(unit.source, SyntheticModel):
        with tempfile.TemporaryDirectory(prefix="cpumoe-sweep-", dir=unit.tmp_dir) as tmp:
            on_case(f"{unit.label}: writing the checkpoint")
            path = _build_synthetic(unit.source, tmp)
            yield from _run_engine(unit, path, on_case)
    else:
        yield from _run_engine(unit, unit.source, on_case)


def _build_synthetic(model: SyntheticModel, out: str) -> str:
    from cpumoe.bench.layer import FLOAT_DTYPES
    from cpumoe.synthetic import make_checkpoint

    return str(make_checkpoint(model.preset, out, layers=model.layers, vocab=model.vocab,
                               dtype=FLOAT_DTYPES[model.dtype], overrides=model.config_overrides()))


def _run_engine(unit: ModelUnit, path: str, on_case: Callable[[str], None]) -> Iterator[Outcome]:
    from cpumoe.bench import model as mb
    from cpumoe.bench.layer import FLOAT_DTYPES
    from cpumoe.engine import LLMEngine

    runs = [mb.ModelCase(*r) for r in unit.runs]
    on_case(f"{unit.label}: loading")
    engine = LLMEngine(path, dtype=FLOAT_DTYPES[unit.dtype] if unit.dtype else None,
                       backend="naive" if unit.impl == "naive" else "auto", config=mb.engine_config(runs))
    try:
        weights = mb.weight_bytes(engine)
        limits = mb.MachineLimits(probe_bytes=(256 << 20) if unit.quick else (1 << 30),
                                  mm_size=mb.QUICK_MM_SIZE if unit.quick else mb.MM_SIZE, dtype=engine.dtype)
        weights_dict = asdict(weights)
        for i, (run, case) in enumerate(zip(runs, unit.cases())):
            on_case(f"{unit.label}: batch {run.batch}, in {run.input_len}, out {run.output_len}")
            if i == 0 or not unit.quick:   # quick: one warm-up per engine, not per run
                mb.run_case(engine, run, limits, weights)
            results = [mb.run_case(engine, run, limits, weights, seed=1 + rep) for rep in range(unit.repeats)]
            result = sorted(results, key=lambda r: r.e2e_s)[len(results) // 2]
            yield Outcome("model", case, "ok", model_metrics(asdict(result), weights_dict),
                          bandwidth_gbs=result.bandwidth_gbs, mm_gflops=result.mm_gflops)
    finally:
        del engine
        gc.collect()


def this_machine() -> dict[str, Any]:
    """The facts that fingerprint the machine this runs on (a Ray task's target)."""
    from cpumoe.bench.results import machine_facts
    return dict(machine_facts())


def execute_all(unit: LayerUnit | ModelUnit, policy: MemoryPolicy) -> list[Outcome]:
    """execute() as a list: what a Ray task returns (the measured medians and the machine's facts)."""
    return list(execute(unit, policy))
