"""The printed report of `cpumoe bench serve`: one table, a row per request rate, then the notes that say how to
read it (the client's ceiling, where output lengths came from, what an ITL gap is) and what went wrong."""
from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from cpumoe.bench.serve.run import SHOWN_ERRORS, RateResult, ServeBench

ITL_NOTES = ("ITL: every gap between consecutive streamed token chunks (a chunk of several tokens: one gap)",
             "TPOT: (E2E - TTFT) / (output tokens - 1) per request; E2E: from the POST to the last token chunk")


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def _stats(metrics: dict, name: str) -> str:
    return "/".join(_num(metrics[f"{stat}_{name}_ms"]) for stat in ("mean", "median", "p90", "p99"))


def table(bench: ServeBench, results: list[RateResult]) -> Table:
    t = Table(title=f"{bench.label}: {bench.target.model}, /{bench.target.endpoint}, {bench.num_prompts} prompts "
                    f"({_dataset(bench)}), burstiness {bench.burstiness:g}, "
                    f"max concurrency {bench.max_concurrency or 'none'}",
              caption="latencies in ms: mean/median/p90/p99", box=box.SIMPLE_HEAD,
              pad_edge=False)
    for header in ("rate", "ok", "fail", "time s", "req/s", "goodput", "in tok/s", "out tok/s", "tok/s"):
        t.add_column(header, justify="right", min_width=min(len(header), 7))
    for header in ("TTFT", "TPOT", "ITL", "E2E"):
        t.add_column(header, justify="right", no_wrap=True)
    for r in results:
        m = r.metrics
        t.add_row(f"{r.request_rate:g}", str(m["completed"]), str(m["failed"]), f"{m['duration']:.2f}",
                  _num(m["request_throughput"]), _num(m["request_goodput"]),
                  _num(m["total_input_tokens"] / m["duration"]), _num(m["output_throughput"]),
                  _num(m["total_token_throughput"]), *(_stats(m, n) for n in ("ttft", "tpot", "itl", "e2el")))
    return t


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}..{hi}"


def _dataset(bench: ServeBench) -> str:
    if bench.dataset == "random":
        return f"random, in {bench.input_len} out {bench.output_len} tokens"
    return bench.dataset


def notes(bench: ServeBench, results: list[RateResult], ceiling_chunks_s: float | None) -> list[str]:
    lines = []
    if ceiling_chunks_s is not None:
        lines.append(f"client ceiling: {ceiling_chunks_s:,.0f} chunks/s (one core, a local flood server); a run "
                     f"streaming near it measures the client")
    sources: dict[str, int] = {}
    for r in results:
        for source, n in r.output_len_sources.items():
            sources[source] = sources.get(source, 0) + n
    if sources:
        lines.append("output lengths from: " + ", ".join(f"{what} ({n} requests)" for what, n in sources.items()))
    done = [o for r in results for o in r.outputs if o.success]
    if done:
        got = sorted(o.output_tokens or 0 for o in done)
        asked = sorted(o.asked_output_len for o in done)
        lines.append(f"output tokens received per request: {_span(got[0], got[-1])} "
                     f"(asked {_span(asked[0], asked[-1])})")
    tokens = sum(o.output_tokens or 0 for o in done)
    chunks = sum(len(o.token_times) for o in done)
    if chunks:
        lines.append(f"streamed chunks carried {tokens / chunks:.2f} tokens each on average (ITL gaps are between "
                     f"chunks, TPOT divides by tokens)")
    if bench.goodput:
        lines.append("goodput SLOs: " + ", ".join(f"{k} <= {v:g} ms" for k, v in bench.goodput.items()))
    lines.extend(ITL_NOTES)
    return lines


def print_report(console: Console, bench: ServeBench, results: list[RateResult], ceiling_chunks_s: float | None,
                 prompt_warnings: list[str]) -> None:
    console.print(table(bench, results))
    for line in notes(bench, results, ceiling_chunks_s):
        console.print(line, highlight=False)
    for line in prompt_warnings:
        console.print(f"warning: {line}", style="yellow", highlight=False, markup=False)
    for r in results:
        for line in r.warnings:
            console.print(f"warning (rate {r.request_rate:g}): {line}", style="yellow", highlight=False, markup=False)
        errors = r.errors()
        if errors:
            console.print(f"failed requests (rate {r.request_rate:g}):", style="red", highlight=False)
            for message, count in errors[:SHOWN_ERRORS]:
                console.print(f"  {count} x {message}", highlight=False, markup=False)
            if len(errors) > SHOWN_ERRORS:
                console.print(f"  ... and {len(errors) - SHOWN_ERRORS} other errors", highlight=False)
