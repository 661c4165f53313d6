"""Runs a sweep's units here or on Ray, skipping what the results database already holds, with a progress bar.

    units -> drop the cases the DB has an ok/oom row for (ResultsDB.done: resume), from this machine or, on Ray,
             from any machine of the cluster (each node's fingerprint, asked of a task pinned to it) -> the rest:
      local  one unit after the other in this process, each case's row written as soon as it is measured
      Ray    each unit a Ray task reserving num_cpus = its threads, launched together; a ray.wait loop takes
             each unit's outcomes as it finishes; only this driver writes the database
A Ctrl-C (or a crash) loses at most the case in flight locally, the units in flight on Ray: the rows already
written stay, and the same command run again resumes from them.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from cpumoe.bench.results import ResultsDB, case_key
from cpumoe.bench.sweep.cases import LayerUnit, ModelUnit
from cpumoe.bench.sweep.memory import MemoryPolicy
from cpumoe.bench.sweep.work import Outcome, execute, execute_all, this_machine

Unit = LayerUnit | ModelUnit
RAY_MISSING = "--ray needs Ray, an optional dependency: pip install cpumoe[ray]"


class SweepError(ValueError):
    """A sweep that cannot start (Ray missing or unreachable, a case larger than every Ray node)."""


@dataclass(slots=True)
class SweepSummary:
    total: int = 0                        # cases in the sweep
    skipped: int = 0                      # already in the database
    statuses: Counter = field(default_factory=Counter)
    outcomes: list[Outcome] = field(default_factory=list)


def pending_units(units: Sequence[Unit], db: ResultsDB | None, machines: Sequence[str] | None = None
                  ) -> tuple[list[Unit], int, int]:
    """(the units with only their cases not done yet, cases skipped, cases in all). A case is done when it has an
    ok/oom row from one of `machines` (fingerprints; default: this machine's). A case that two units share (the
    skeleton reached twice) runs once."""
    seen: set[str] = set()
    keep, skipped, total = [], 0, 0
    for unit in units:
        todo = []
        for case in unit.cases():
            key = case_key(case)
            if key in seen:
                continue
            seen.add(key)
            total += 1
            if db is not None and any(db.done(unit.bench, case, machine) for machine in machines or [None]):
                skipped += 1
            else:
                todo.append(case)
        if todo:
            keep.append(unit.keep(todo))
    return keep, skipped, total


def run_sweep(units: Sequence[Unit], *, db: ResultsDB | None, policy: MemoryPolicy = MemoryPolicy(),
              ray: bool = False, machines: Sequence[str] | None = None,
              console: Console | None = None) -> SweepSummary:
    """Runs every case of `units` not yet in `db` (all of them without a db), writing each outcome's row. With
    `ray`, on the Ray runtime connect_ray() joined, skipping what any of its machines (`machines`; default: found
    with cluster_machines) has done."""
    if ray and machines is None:
        machines = cluster_machines()
    todo, skipped, total = pending_units(units, db, machines)
    summary = SweepSummary(total=total, skipped=skipped)
    cases = sum(len(u.cases()) for u in todo)

    def record(outcome: Outcome) -> None:
        if db is not None:
            db.add(outcome.bench, outcome.case, outcome.metrics, status=outcome.status,
                   bandwidth_gbs=outcome.bandwidth_gbs, mm_gflops=outcome.mm_gflops,
                   machine_facts=outcome.machine_facts or None)
        summary.statuses[outcome.status] += 1
        summary.outcomes.append(outcome)

    columns = (TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("left"), TimeRemainingColumn())
    with Progress(*columns, console=console or Console(stderr=True), disable=not cases,
                  transient=True) as bar:
        task = bar.add_task("starting", total=cases)

        def advance(outcome: Outcome) -> None:
            record(outcome)
            bar.advance(task)

        if ray:
            _run_ray(todo, policy, advance, lambda text: bar.update(task, description=text))
        else:
            for unit in todo:
                bar.update(task, description=unit.label)
                for outcome in execute(unit, policy, on_case=lambda what: bar.update(task, description=what)):
                    advance(outcome)
    return summary


def import_ray():
    try:
        import ray
    except ImportError:
        raise SweepError(RAY_MISSING) from None
    return ray


def connect_ray(address: str | None):
    """Ray, started here (no address) or connected to the cluster at `address`; SweepError when it cannot be."""
    ray = import_ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address) if address else ray.init()
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise SweepError(f"cannot start or reach Ray{f' at {address}' if address else ''}: {e}") from None
    return ray


def cluster_machines() -> list[str]:
    """The fingerprints of the Ray cluster's machines (one small task pinned to each live node), and this one's."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cpumoe.bench.results import fingerprint, machine_facts

    ray = import_ray()
    probe = ray.remote(num_cpus=0)(this_machine)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote()
            for node in ray.nodes() if node.get("Alive")]
    return list(dict.fromkeys([fingerprint(machine_facts()), *(fingerprint(f) for f in ray.get(refs))]))


def _run_ray(units: Sequence[Unit], policy: MemoryPolicy, on_outcome: Callable[[Outcome], None],
             describe: Callable[[str], None]) -> None:
    ray = import_ray()
    if not units:
        return
    largest = max((node["Resources"].get("CPU", 0) for node in ray.nodes() if node.get("Alive")), default=0)
    too_wide = sorted({u.threads for u in units if u.threads > largest})
    if too_wide:
        raise SweepError(f"--threads {too_wide[0]} is more CPUs than any Ray node has ({largest:g}): the tasks "
                         "would never be scheduled")
    task = ray.remote(execute_all)
    pending = {task.options(num_cpus=u.threads).remote(u, policy): u for u in units}
    while pending:
        describe(f"Ray: {len(pending)} unit(s) queued or running")
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            unit = pending.pop(ref)
            try:
                outcomes = ray.get(ref)
            except ray.exceptions.RayError as e:   # the worker died (killed, out of memory) or the task failed
                message = f"Ray task failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                outcomes = [Outcome(unit.bench, c, "error", dict(message=message)) for c in unit.cases()]
            for outcome in outcomes:
                on_outcome(outcome)
