"""Thread scaling: the fused experts op (`bench layer`) and the engine's decode step (`bench model`) at each thread
count, each count in processes of its own (a pool's threads, torch's and cpumoe's, are sized once per process), and
the ratios to the first count.

Every count measures its own read probe too: on a server one thread cannot draw the socket's bandwidth, so "% of
the probe" says how much of what that many threads can stream the step used, and the probe's own growth is the
ceiling the step's scaling is measured against.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from rich.console import Console
from rich.table import Table

from cpumoe.bench.layer import REFERENCE_DTYPE, WeightFormat, oracle_choice
from cpumoe.presets import LayerPreset


@dataclass(slots=True)
class ThreadsRow:
    threads: int
    layer_probe_gbs: float                                  # bench layer's read probe at this count
    experts_ms: dict[int, float] = field(default_factory=dict)          # M -> ms per fused experts call
    experts_probe_pct: dict[int, float] = field(default_factory=dict)   # M -> % of that run's probe
    decode_tok_s: dict[int, float] = field(default_factory=dict)        # batch -> decode tokens/s
    decode_probe_pct: dict[int, float] = field(default_factory=dict)    # batch -> bytes read / probe
    model_probe_gbs: float = float("nan")                   # bench model's probe (mean around its cases)


def layer_command(preset: LayerPreset, backend: str, tokens: Sequence[int], threads: int, out: Path,
                  quick: bool) -> list[str]:
    return [sys.executable, "-m", "cpumoe", "bench", "layer", "--preset", preset.name, "--dtype", "bf16",
            "--backends", backend, "--tokens", ",".join(map(str, tokens)), "--threads", str(threads),
            "--json", str(out), "--no-db"] + (["--quick"] if quick else [])


def model_command(model: str, batches: Sequence[int], input_len: int, output_len: int, threads: int, out: Path,
                  repeats: int) -> list[str]:
    return [sys.executable, "-m", "cpumoe", "bench", "model", model, "--batch", ",".join(map(str, batches)),
            "--input-len", str(input_len), "--output-len", str(output_len), "--threads", str(threads),
            "--repeats", str(repeats), "--json", str(out), "--no-db"]


def row_from_reports(threads: int, layer: dict | None, model: dict | None) -> ThreadsRow:
    """One count's row from its bench layer and bench model JSON reports (either may be None: not run)."""
    row = ThreadsRow(threads, layer["machine"]["bandwidth_gbs"] if layer else float("nan"))
    for r in (layer or {}).get("results", []):
        row.experts_ms[r["tokens"]] = r["ms"]
        row.experts_probe_pct[r["tokens"]] = r["bandwidth_pct"]
    results = (model or {}).get("results", [])
    for r in results:
        row.decode_tok_s[r["batch"]] = r["decode_tok_s"]
        row.decode_probe_pct[r["batch"]] = r["decode_bandwidth_pct"]
    if results:
        row.model_probe_gbs = sum(r["bandwidth_gbs"] for r in results) / len(results)
    return row


def run_thread_scaling(model: str | None, preset: LayerPreset, threads: Sequence[int], *,
                       tokens: Sequence[int] = (1, 16), batches: Sequence[int] = (1, 16), input_len: int = 128,
                       output_len: int = 32, repeats: int = 1, quick: bool = False,
                       on_step: Callable[[str], None] = lambda what: None) -> dict:
    """Runs bench layer (the oracle's bf16 backend) and, given a checkpoint, bench model at each thread count, in
    child processes, and returns {"backend", "rows": [ThreadsRow as dict], "commands"}. A child that fails stops
    the run with its output (CalledProcessError)."""
    backend = oracle_choice(preset, WeightFormat(REFERENCE_DTYPE))
    if backend is None:
        raise ValueError(f"no experts backend of this CPU runs bf16 {preset.name}")
    rows, commands = [], []
    with tempfile.TemporaryDirectory(prefix="cpumoe-threads-") as tmp:
        for n in threads:
            reports = {}
            jobs = [("layer", layer_command(preset, backend, tokens, n, Path(tmp) / f"layer-{n}.json", quick))]
            if model is not None:
                jobs.append(("model", model_command(model, batches, input_len, output_len, n,
                                                    Path(tmp) / f"model-{n}.json", repeats)))
            for kind, command in jobs:
                on_step(f"{n} threads: bench {kind}")
                commands.append(" ".join(command[1:]))
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                reports[kind] = json.loads(Path(command[command.index("--json") + 1]).read_text())
            rows.append(row_from_reports(n, reports.get("layer"), reports.get("model")))
    return dict(backend=backend, preset=preset.name, model=model, input_len=input_len, output_len=output_len,
                rows=[asdict(r) for r in rows], commands=commands)


def _at(by_count: dict, key: int) -> float:
    """by_count[key], whether the dict came straight from asdict (int keys) or back from JSON (str keys)."""
    return by_count.get(key, by_count.get(str(key), float("nan")))


def _scaling(value: float, first: float, higher_is_better: bool) -> str:
    if not (first > 0 and value > 0):
        return "-"
    return f"{(value / first if higher_is_better else first / value):.2f}x"


def render_thread_scaling(report: dict, console: Console) -> None:
    """One table: per count, the probe, each M's experts call and each batch's decode, with the speed-up over the
    first count beside each (the probe's own growth is the ceiling of a bandwidth-bound figure's)."""
    rows = report["rows"]
    first = rows[0]
    tokens = sorted({int(m) for r in rows for m in r["experts_ms"]})
    batches = sorted({int(b) for r in rows for b in r["decode_tok_s"]})
    table = Table(title=f"thread scaling: {report['preset']} experts on {report['backend']}"
                        + (f", decode of {report['model']} ({report['input_len']}-token prompts)"
                           if report["model"] else ""))
    table.add_column("threads", justify="right")
    table.add_column("probe GB/s (x)", justify="right")
    for m in tokens:
        table.add_column(f"experts M={m} ms (x, % probe)", justify="right")
    for b in batches:
        table.add_column(f"decode b{b} tok/s (x, % bw)", justify="right")
    for r in rows:
        cells = [str(r["threads"]),
                 f"{r['layer_probe_gbs']:.1f} ({_scaling(r['layer_probe_gbs'], first['layer_probe_gbs'], True)})"]
        for m in tokens:
            ms = _at(r["experts_ms"], m)
            cells.append(f"{ms:.2f} ({_scaling(ms, _at(first['experts_ms'], m), False)}, "
                         f"{_at(r['experts_probe_pct'], m):.0f}%)")
        for b in batches:
            tok_s = _at(r["decode_tok_s"], b)
            cells.append(f"{tok_s:.1f} ({_scaling(tok_s, _at(first['decode_tok_s'], b), True)}, "
                         f"{_at(r['decode_probe_pct'], b):.0f}%)")
        table.add_row(*cells)
    console.print(table)
