"""What a sweep prints: before it starts, the plan (cases, skipped, those that will not fit, the estimated time);
after, one table of the cases it ran and the count of each status."""
from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from cpumoe.bench.sweep.memory import MemoryPolicy
from cpumoe.bench.sweep.runner import SweepSummary


def print_plan(console: Console, args, units: Sequence, skipped: int, total: int, db) -> None:
    """Cases to run, skipped and predicted out of memory now, and the estimated time (from this machine's quick
    bandwidth and GEMM measurement; the estimate assumes the cases run here, one after the other)."""
    import torch

    from cpumoe.bench.sweep.work import machine_info

    where = f" already in {db.path}" if db is not None else ""
    todo = sum(len(u.cases()) for u in units)
    console.print(f"[bold]{total}[/] cases in {len(units)} units; [bold]{skipped}[/] skipped{where}; "
                  f"[bold]{todo}[/] to run")
    if not units:
        return
    budget, _ = MemoryPolicy(limit_bytes=None if args.max_memory_gb is None else int(args.max_memory_gb * 1e9)
                             ).budget()
    too_large = [u for u in units if u.bytes_needed() > budget]
    if too_large:
        console.print(f"{sum(len(u.cases()) for u in too_large)} of them do not fit in {budget / 1e9:.1f} GB now and "
                      f"will be recorded as oom (largest needs {max(u.bytes_needed() for u in too_large) / 1e9:.1f} "
                      "GB)")
    machine = machine_info(args.threads, torch.bfloat16)
    seconds = sum(u.estimate_s(machine.bandwidth_gbs, machine.mm_gflops) for u in units if u not in too_large)
    console.print(f"estimated time: [bold]{_duration(seconds)}[/] (rough; this machine reads "
                  f"{machine.bandwidth_gbs:.1f} GB/s and multiplies at {machine.mm_gflops:.0f} GFLOP/s)")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def print_summary(console: Console, summary: SweepSummary, db_path: str | None) -> None:
    if summary.outcomes:
        console.print(_layer_table(summary) if summary.outcomes[0].bench == "layer" else _model_table(summary))
    counts = ", ".join(f"{n} {status}" for status, n in sorted(summary.statuses.items()))
    where = f"; rows in {db_path}" if db_path else "; nothing written (--no-db)"
    console.print(f"{summary.total} cases: {counts or 'none run'}; {summary.skipped} skipped (already done){where}")
    errors: dict[str, list[dict]] = {}
    for o in summary.outcomes:
        if o.status == "error":
            errors.setdefault(o.metrics["message"], []).append(o.case)
    for message, cases in errors.items():   # one line per distinct failure
        console.print(f"[red]{len(cases)} case(s) failed[/], e.g. {_case_text(cases[0])}: {message}")


def _case_text(case: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in case.items())


def _status(o) -> str:
    if o.status == "oom":
        return f"[yellow]oom[/] ({o.metrics['bytes_needed'] / 1e9:.1f} GB)"
    return "[red]error[/]" if o.status == "error" else "ok"


def _layer_table(summary: SweepSummary) -> Table:
    table = Table(title="MoE layer sweep (quick timing unless --full; % of the read bandwidth and GEMM rate "
                        "measured beside each case)", title_justify="left")
    for name in ("H", "I", "E", "k", "format", "backend", "M", "ms", "GFLOP/s", "GB/s", "% bw", "% mm", "status"):
        table.add_column(name, justify="left" if name in ("format", "backend", "status") else "right", no_wrap=True)
    for o in summary.outcomes:
        c, m = o.case, o.metrics
        ok = o.status == "ok"
        table.add_row(str(c["hidden"]), str(c["inter"]), str(c["experts"]), str(c["top_k"]), c["format"], c["backend"],
                      str(c["tokens"]), f"{m['time_ms']:.3f}" if ok else "", f"{m['gflops']:.1f}" if ok else "",
                      f"{m['gbs']:.1f}" if ok else "", f"{m['pct_bandwidth']:.0f}%" if ok else "",
                      f"{m['pct_peak']:.0f}%" if ok else "", _status(o))
    return table


def _model_table(summary: SweepSummary) -> Table:
    table = Table(title="model sweep (ITL and throughput as MoE-Inference-Bench defines them)", title_justify="left")
    for name in ("model", "H", "I", "E", "k", "format", "experts", "batch", "in", "out", "TTFT ms", "ITL ms",
                 "tok/s", "decode tok/s", "% bw", "peak RSS GB", "status"):
        table.add_column(name, justify="left" if name in ("model", "format", "experts", "status") else "right",
                         no_wrap=name != "model")
    for o in summary.outcomes:
        c, m = o.case, o.metrics
        ok = o.status == "ok"
        num = lambda key, fmt, unit="": "" if not ok or m.get(key) is None else format(m[key], fmt) + unit  # noqa
        table.add_row(c["model"], str(c["hidden"]), str(c["inter"]), str(c["experts"]), str(c["top_k"]),
                      c["format"], c["impl"], str(c["batch"]), str(c["input_len"]), str(c["output_len"]),
                      num("ttft_ms", ".1f"), num("itl_ms", ".2f"), num("throughput_tok_s", ".1f"),
                      num("decode_tok_s", ".1f"), num("decode_pct_bandwidth", ".0f", "%"), num("peak_rss_gb", ".2f"),
                      _status(o))
    return table
