"""The database's rows as cases: the repeats of one case on one machine folded into a median and a range.

    rows (ResultsDB.rows) -> group by (bench, case, machine) -> Case: the ok rows when there are any, else the
    oom rows, else the error rows; Case.stat(metric) -> Stat(median, lo, hi, n) over those rows

Rows from different machines never share a Case (so never a curve): `Machines` names each fingerprint (M1, M2, ...)
and keeps what the page shows about it. The layer figures follow the paper's sweeps around a skeleton
(hidden, inter, experts, top_k): the most common shape among the layer rows unless one is given.
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from cpumoe.bench.results import Row, case_key

LAYER_AXES = ("inter", "experts", "top_k", "hidden")   # the skeleton's parameters, in the order --skeleton takes

# A percentage a row may lack, computed from its own measurement and the limit its run measured:
# metric -> (the achieved rate in metrics, the Row attribute with the machine's limit)
_DERIVED_PCT = {"pct_bandwidth": ("gbs", "bandwidth_gbs"), "pct_peak": ("gflops", "mm_gflops")}


@dataclass(frozen=True, slots=True)
class Stat:
    """The median of a metric over a case's runs, with the lowest and highest run."""
    median: float
    lo: float
    hi: float
    n: int
    integral: bool = False   # every run's value was an int (counts, tokens): shown without decimals when whole

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Stat | None:
        kept = [v for v in values if _is_number(v)]
        if not kept:
            return None
        return cls(median=statistics.median(kept), lo=min(kept), hi=max(kept), n=len(kept),
                   integral=all(isinstance(v, int) for v in kept))

    def value(self, x: float) -> float | int:
        """x (the median, lo or hi) as an int when the runs were ints and x is whole."""
        return int(x) if self.integral and float(x).is_integer() else x

    @property
    def spread(self) -> bool:
        return self.n > 1 and self.hi > self.lo


@dataclass(slots=True)
class Case:
    bench: str
    params: dict[str, Any]
    machine: str
    status: str              # 'ok' when any run was ok, else 'oom' when any was, else 'error'
    rows: list[Row]          # the runs of that status, oldest first
    runs: int                # every row of the case, whatever its status

    def get(self, key: str) -> Any:
        return self.params.get(key)

    def stat(self, metric: str) -> Stat | None:
        return Stat.of(_metric(row, metric) for row in self.rows)

    def median(self, metric: str) -> float | None:
        s = self.stat(metric)
        return None if s is None else s.median

    def limit(self, name: str) -> Stat | None:
        """'bandwidth_gbs' or 'mm_gflops': the machine's limits the runs of this case measured."""
        return Stat.of(getattr(row, name) for row in self.rows)

    def series(self, metric: str) -> list[Any] | None:
        """A list metric (experts' counts, per-layer figures) as the element-wise median over the runs."""
        values = [row.metrics.get(metric) for row in self.rows if isinstance(row.metrics.get(metric), list)]
        if not values:
            return None
        return _elementwise_median(values)

    def series_stat(self, metric: str) -> list[Stat | None] | None:
        """A flat list metric as one Stat per element (the runs' median and range)."""
        values = [row.metrics.get(metric) for row in self.rows if isinstance(row.metrics.get(metric), list)]
        if not values:
            return None
        length = max(len(v) for v in values)
        return [Stat.of(v[i] for v in values if i < len(v)) for i in range(length)]

    def message(self) -> str:
        """Why an oom or error case has no measurement (its newest row's metrics)."""
        metrics = self.rows[-1].metrics
        if self.status == "oom":
            need, have = metrics.get("bytes_needed"), metrics.get("bytes_available")
            if _is_number(need) and _is_number(have):
                return f"needs {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available"
        return str(metrics.get("message") or metrics.get("error") or "")


def group_cases(rows: Sequence[Row]) -> list[Case]:
    """One Case per (bench, case, machine), in the order of each case's first row."""
    grouped: dict[tuple[str, str, str], tuple[dict[str, Any], list[Row]]] = {}
    for row in rows:
        params = _params(row)
        grouped.setdefault((row.bench, case_key(params), row.machine), (params, []))[1].append(row)
    cases = []
    for (bench, _key, machine), (params, runs) in grouped.items():
        status = next(s for s in ("ok", "oom", "error") if any(r.status == s for r in runs))
        cases.append(Case(bench=bench, params=params, machine=machine, status=status,
                          rows=[r for r in runs if r.status == status], runs=len(runs)))
    return cases


def _params(row: Row) -> dict[str, Any]:
    """A row's case parameters. Layer rows of databases written before the kernel choice was called "backend" name
    it "path": read as "backend", so an older database still renders (and its rows join newer ones of the case)."""
    if row.bench != "layer" or "path" not in row.case or "backend" in row.case:
        return dict(row.case)
    return {("backend" if k == "path" else k): v for k, v in row.case.items()}


@dataclass(frozen=True, slots=True)
class Machine:
    fingerprint: str
    label: str                 # M1, M2, ... in the order the machines first appear
    info: dict[str, Any]       # ResultsDB's machine facts: cpu, features, cores, memory_gb
    bandwidth: Stat | None     # the read bandwidth its runs measured, GB/s
    mm: Stat | None            # the GEMM rate its runs measured, GFLOP/s
    versions: tuple[str, ...]
    commits: tuple[str, ...]
    rows: int


@dataclass(slots=True)
class Machines:
    by_fingerprint: dict[str, Machine] = field(default_factory=dict)

    @classmethod
    def of(cls, rows: Sequence[Row]) -> Machines:
        seen: dict[str, list[Row]] = {}
        for row in rows:
            seen.setdefault(row.machine, []).append(row)
        machines = {}
        for i, (fp, runs) in enumerate(seen.items(), start=1):
            machines[fp] = Machine(
                fingerprint=fp, label=f"M{i}", info=runs[-1].machine_info,
                bandwidth=Stat.of(r.bandwidth_gbs for r in runs), mm=Stat.of(r.mm_gflops for r in runs),
                versions=tuple(dict.fromkeys(r.version for r in runs)),
                commits=tuple(dict.fromkeys(r.git_commit for r in runs if r.git_commit)), rows=len(runs))
        return cls(machines)

    @property
    def several(self) -> bool:
        return len(self.by_fingerprint) > 1

    def label(self, fingerprint: str) -> str:
        return self.by_fingerprint[fingerprint].label

    def __iter__(self):
        return iter(self.by_fingerprint.values())

    def __len__(self) -> int:
        return len(self.by_fingerprint)


@dataclass(frozen=True, slots=True)
class Skeleton:
    """The shape the layer sweeps vary one parameter of (the paper's: Mixtral-8x7B, 4096, 14336, 8, 2)."""
    hidden: int
    inter: int
    experts: int
    top_k: int

    @classmethod
    def parse(cls, text: str) -> Skeleton:
        parts = [p.strip() for p in text.split(",")]
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 4 or min(values) < 1:
            raise ValueError(f"expected the skeleton as four positive integers H,I,E,k, got {text!r}")
        return cls(*values)

    @classmethod
    def most_common(cls, cases: Sequence[Case]) -> Skeleton | None:
        """The (hidden, inter, experts, top_k) of the most layer rows (the first to appear among equals)."""
        counts: Counter[tuple] = Counter()
        for case in cases:
            shape = tuple(case.get(a) for a in ("hidden", "inter", "experts", "top_k"))
            if all(isinstance(v, int) for v in shape):
                counts[shape] += case.runs
        if not counts:
            return None
        return cls(*counts.most_common(1)[0][0])

    def value(self, axis: str) -> int:
        return getattr(self, axis)

    def describe(self) -> str:
        return f"H={self.hidden} I={self.inter} E={self.experts} k={self.top_k}"


def on_axis(cases: Sequence[Case], skeleton: Skeleton, axis: str) -> list[Case]:
    """The layer cases where every skeleton parameter but `axis` is the skeleton's."""
    others = [a for a in LAYER_AXES if a != axis]
    return [c for c in cases if all(c.get(a) == skeleton.value(a) for a in others) and _is_number(c.get(axis))]


def most_common_values(cases: Sequence[Case], keys: Sequence[str]) -> tuple | None:
    """The most frequent tuple of `keys` among the cases (by rows; the first to appear among equals)."""
    counts: Counter[tuple] = Counter()
    for case in cases:
        counts[tuple(case.get(k) for k in keys)] += case.runs
    return counts.most_common(1)[0][0] if counts else None


def _metric(row: Row, metric: str) -> Any:
    value = row.metrics.get(metric)
    if value is None and metric in _DERIVED_PCT:
        rate, limit = row.metrics.get(_DERIVED_PCT[metric][0]), getattr(row, _DERIVED_PCT[metric][1])
        if _is_number(rate) and _is_number(limit) and limit > 0:
            return 100.0 * rate / limit
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _elementwise_median(values: list[list]) -> list:
    if values[0] and isinstance(values[0][0], list):   # [L][E] per run: recurse per layer
        rows = max(len(v) for v in values)
        return [_elementwise_median([v[i] for v in values if i < len(v)]) for i in range(rows)]
    length = max(len(v) for v in values)
    out = []
    for i in range(length):
        s = Stat.of(v[i] for v in values if i < len(v))
        out.append(None if s is None else s.value(s.median))
    return out
