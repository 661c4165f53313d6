"""The report's tables: one per figure (the points it draws) and one per bench with every case.

A Table is columns and rows of cells; a cell is text, a number, None (not measured) or a Stat (a case measured
more than once: the median, and the lowest and highest run). page.py and export.py render the same Table, so the
page, tables.md and csv/<name>.csv always agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from cpumoe.report.cases import Case, Machines, Stat


@dataclass(frozen=True, slots=True)
class Column:
    key: str                         # the CSV header (a Stat column adds <key>_lo and <key>_hi)
    label: str                       # the page's header
    get: Callable[[Case], Any] | None = None   # how Table.of reads a case (None: a table built row by row)
    stat: bool = False               # cells are Stat (or None)


@dataclass(slots=True)
class Table:
    name: str                        # file-safe: csv/<name>.csv, the page's anchor
    title: str
    columns: list[Column]
    rows: list[list[Any]]

    @classmethod
    def of(cls, name: str, title: str, columns: Sequence[Column], cases: Sequence[Case]) -> Table:
        rows = [[column.get(case) for column in columns] for case in cases]
        return cls(name=name, title=title, columns=list(columns), rows=rows)


def param(key: str, label: str | None = None) -> Column:
    return Column(key, label or key, lambda case: case.get(key))


def metric(key: str, label: str) -> Column:
    return Column(key, label, lambda case: case.stat(key), stat=True)


def limit(name: str, label: str) -> Column:
    return Column(name, label, lambda case: case.limit(name), stat=True)


def run_columns(machines: Machines) -> list[Column]:
    """Machine (when the database holds several), number of runs, and status with why a case did not run."""
    columns = []
    if machines.several:
        columns.append(Column("machine", "machine", lambda case: machines.label(case.machine)))
    columns.append(Column("runs", "runs", lambda case: case.runs))
    columns.append(Column("status", "status", _status))
    return columns


def _status(case: Case) -> str:
    why = case.message() if case.status != "ok" else ""
    return f"{case.status}: {why}" if why else case.status


# ---- per bench: the columns of its contract ----------------------------------------------------------------------

def layer_columns(machines: Machines) -> list[Column]:
    return [param("preset"), param("hidden", "H"), param("inter", "I"), param("experts", "E"), param("top_k", "k"),
            param("format"), param("backend"), param("impl"), param("tokens", "M"), param("threads"),
            *run_columns(machines),
            metric("time_ms", "time ms"), metric("gflops", "GFLOP/s"), metric("gbs", "GB/s"),
            metric("pct_bandwidth", "% read BW"), metric("pct_peak", "% GEMM peak"),
            limit("bandwidth_gbs", "BW GB/s"), limit("mm_gflops", "GEMM GFLOP/s")]


def speedup_table(name: str, title: str, pairs: Sequence[tuple[Case, Case]], machines: Machines) -> Table:
    """One row per (fused, naive) pair of layer cases that differ only in impl and backend."""
    columns = [Column(k, label) for k, label in (("hidden", "H"), ("inter", "I"), ("experts", "E"), ("top_k", "k"),
                                                 ("format", "format"), ("tokens", "M"), ("backend", "fused backend"))]
    if machines.several:
        columns.append(Column("machine", "machine"))
    columns += [Column("fused_ms", "fused ms", stat=True), Column("naive_ms", "naive ms", stat=True),
                Column("speedup", "speed-up", stat=True)]
    rows = []
    for fused, naive in pairs:
        rows.append([*(fused.get(c.key) for c in columns[:7]),
                     *([machines.label(fused.machine)] if machines.several else []),
                     fused.stat("time_ms"), naive.stat("time_ms"), speedup(fused, naive)])
    return Table(name=name, title=title, columns=columns, rows=rows)


def speedup(fused: Case, naive: Case) -> Stat | None:
    """naive time / fused time: the median ratio of medians, the range from the extremes of both."""
    return _ratio(naive.stat("time_ms"), fused.stat("time_ms"))


def model_columns(machines: Machines) -> list[Column]:
    return [param("model"), param("format"), param("impl"), param("batch"), param("input_len", "in"),
            param("output_len", "out"), param("threads"), param("layers"), *run_columns(machines),
            metric("ttft_ms", "TTFT ms"), metric("itl_ms", "ITL ms"), metric("e2e_s", "e2e s"),
            metric("throughput_tok_s", "throughput tok/s"), metric("decode_tok_s", "decode tok/s"),
            metric("prefill_tok_s", "prefill tok/s"), metric("decode_pct_bandwidth", "decode % BW"),
            metric("prefill_pct_peak", "prefill % peak"), metric("peak_rss_gb", "peak RSS GB")]


SERVE_PERCENTILES = (("median", "p50"), ("p90", "p90"), ("p99", "p99"))


def serve_columns(machines: Machines) -> list[Column]:
    columns = [param("label"), param("model"), param("dataset"), param("input_len", "in"), param("output_len", "out"),
               param("num_prompts", "prompts"), param("request_rate", "rate"), param("burstiness"),
               param("max_concurrency", "conc."),
               *run_columns(machines),
               metric("completed", "done"), metric("failed", "failed"), metric("request_throughput", "req/s"),
               metric("output_throughput", "out tok/s"), metric("total_token_throughput", "total tok/s")]
    for what in ("ttft", "tpot", "itl", "e2el"):
        for key, label in SERVE_PERCENTILES:
            columns.append(metric(f"{key}_{what}_ms", f"{what.upper()} {label} ms"))
    columns.append(metric("request_goodput", "goodput req/s"))
    return columns


def prune_columns(machines: Machines) -> list[Column]:
    return [param("model"), param("method"), param("ratio"), *run_columns(machines),
            metric("perplexity", "perplexity"), metric("top1_agreement", "top-1 agreement"),
            metric("kl_divergence", "KL"), metric("decode_tok_s", "decode tok/s"),
            metric("prefill_tok_s", "prefill tok/s"), metric("speedup_decode", "decode speed-up"),
            metric("speedup_prefill", "prefill speed-up"), metric("expert_params", "expert params")]


def experts_layer_table(name: str, title: str, case: Case) -> Table:
    """One row per layer of an experts case: how uneven its routing was."""
    keys = {"max_over_mean": "max / mean", "cv": "CV", "entropy": "entropy (bits)", "entropy_norm": "entropy / log2 E",
            "never_chosen": "never chosen"}
    per_metric = {k: case.series_stat(k) or [] for k in keys}
    counts = case.series("counts") or []   # [L][E]
    length = max([len(v) for v in per_metric.values()] + [len(counts)])
    layers = case.series("layers") or []   # the decoder layer of each MoE layer, where the row names them
    if len(layers) != length:
        layers = list(range(length))
    columns = [Column("layer", "layer"), Column("tokens_routed", "tokens routed"),
               *[Column(k, label, stat=True) for k, label in keys.items()]]
    rows = []
    for i, layer in enumerate(layers):
        routed = sum(v for v in counts[i] if v is not None) if i < len(counts) else None
        rows.append([layer, routed, *[(v[i] if i < len(v) else None) for v in per_metric.values()]])
    return Table(name=name, title=title, columns=columns, rows=rows)


def experts_distinct_table(name: str, title: str, cases: Sequence[Case], machines: Machines) -> Table:
    """One row per (case, batch size): distinct experts a batch touches, measured and if routing were uniform."""
    columns = [Column("model", "model"), Column("prompts", "prompts"),
               *([Column("machine", "machine")] if machines.several else []),
               Column("batch", "batch"),
               Column("distinct_measured", "distinct measured", stat=True),
               Column("distinct_uniform", "distinct if uniform", stat=True)]
    rows = []
    for case in cases:
        batches = case.series("distinct_batches") or []
        measured, uniform = case.series_stat("distinct_measured") or [], case.series_stat("distinct_uniform") or []
        for i, batch in enumerate(batches):
            rows.append([case.get("model"), case.get("prompts"),
                         *([machines.label(case.machine)] if machines.several else []), batch,
                         measured[i] if i < len(measured) else None, uniform[i] if i < len(uniform) else None])
    return Table(name=name, title=title, columns=columns, rows=rows)


def machines_table(machines: Machines) -> Table:
    columns = [Column(k, label, stat=k in ("bandwidth_gbs", "mm_gflops")) for k, label in (
        ("machine", "machine"), ("fingerprint", "fingerprint"), ("cpu", "CPU"), ("cores", "cores"),
        ("memory_gb", "memory GB"), ("features", "features"), ("bandwidth_gbs", "read BW GB/s"),
        ("mm_gflops", "GEMM GFLOP/s"), ("version", "cpumoe"), ("commit", "commit"), ("rows", "rows"))]
    rows = [[m.label, m.fingerprint, m.info.get("cpu"), m.info.get("cores"), m.info.get("memory_gb"),
             " ".join(m.info.get("features") or []), m.bandwidth, m.mm, ", ".join(m.versions),
             ", ".join(c[:12] for c in m.commits), m.rows] for m in machines]
    return Table(name="machines",
                 title="Machines: what each ran on, and the limits its runs measured (range over runs)",
                 columns=columns, rows=rows)


def generic_columns(cases: Sequence[Case], machines: Machines) -> list[Column]:
    """A bench without a contract here: its case parameters, then every scalar metric it wrote."""
    params = list(dict.fromkeys(k for c in cases for k in c.params))
    metrics = list(dict.fromkeys(k for c in cases for r in c.rows if c.status == "ok" for k, v in r.metrics.items()
                                 if isinstance(v, (int, float)) and not isinstance(v, bool)))
    return [*[param(k) for k in params], *run_columns(machines), *[metric(k, k) for k in metrics]]


def errors_table(name: str, title: str, cases: Sequence[Case], machines: Machines) -> Table:
    columns = [Column("case", "case", lambda c: ", ".join(f"{k}={v}" for k, v in c.params.items())),
               *([Column("machine", "machine", lambda c: machines.label(c.machine))] if machines.several else []),
               Column("runs", "runs", lambda c: c.runs), Column("message", "message", lambda c: c.message())]
    return Table.of(name, title, columns, cases)


# ---- cells as text -----------------------------------------------------------------------------------------------

def format_number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return "0" if magnitude == 0 else f"{value:.3g}"


def format_cell(value: Any) -> str:
    """A cell as the page and tables.md show it: a Stat with a spread as 'median (lo–hi)'."""
    if value is None:
        return "–"
    if isinstance(value, Stat):
        text = format_number(value.value(value.median))
        if not value.spread:
            return text
        return f"{text} ({format_number(value.value(value.lo))}–{format_number(value.value(value.hi))})"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return format_number(value)
    return str(value)


def _ratio(num: Stat | None, den: Stat | None) -> Stat | None:
    """num / den as a Stat: the median of the ratio of medians, the range from the extremes of both."""
    if num is None or den is None or den.median <= 0 or den.lo <= 0:
        return None
    return Stat(median=num.median / den.median, lo=num.lo / den.hi, hi=num.hi / den.lo, n=max(num.n, den.n))
