"""The report's figures: one function per kind, each writing one small PNG (matplotlib Agg, 800x500 px at 100 dpi).

Every function takes the cases to draw and returns whether it drew anything (no rows, no file). A curve is one
series of cases that differ only along the x axis; a case run several times is drawn at its median with an error
bar from its lowest to its highest run. Series from different machines are separate curves, labelled M1, M2, ...
Layer and model figures draw, beside time or throughput, the percent of the read bandwidth and GEMM rate that the
same runs measured, so every curve is read against this machine's limits.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.ticker import MaxNLocator  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

from cpumoe.report.cases import Case, Machines, Skeleton, Stat  # noqa: E402

FIGSIZE = (8.0, 5.0)   # inches: 800 x 500 px at DPI
DPI = 100
COLORS = plt.get_cmap("tab10").colors
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
AXIS_NAMES = {"inter": "FFN dimension I", "experts": "number of experts E", "top_k": "active experts k",
              "hidden": "hidden size H", "batch": "batch size", "input_len": "input length (tokens)",
              "output_len": "output length (tokens)", "tokens": "tokens M", "request_rate": "request rate (req/s)",
              "max_concurrency": "concurrent requests (limit)"}


@dataclass(slots=True)
class Series:
    """One curve: its identity (what its cases share) and its cases, sorted along x."""
    key: tuple
    ident: dict[str, Any]
    cases: list[Case]


def group_series(cases: Sequence[Case], fields: Sequence[str], x: str, machines: Machines) -> list[Series]:
    """Cases with equal `fields` (and machine) as one Series each, in first-appearance order, sorted by `x`."""
    groups: dict[tuple, Series] = {}
    for case in cases:
        ident = {f: case.get(f) for f in fields}
        if machines.several:   # then every label names its machine
            ident["machine"] = machines.label(case.machine)
        key = tuple(ident.values())
        groups.setdefault(key, Series(key=key, ident=ident, cases=[])).cases.append(case)
    for s in groups.values():
        s.cases.sort(key=lambda c: sort_key(c.get(x)))
    return list(groups.values())


def series_labels(series: Sequence[Series], names: dict[str, str] | None = None) -> list[str]:
    """Each series named by the fields that differ between them (all the same: the first field's value), and by its
    machine whenever the database holds several."""
    names = names or {}
    if not series:
        return []
    fields = list(series[0].ident)
    varying = [f for f in fields if len({repr(s.ident.get(f)) for s in series}) > 1]
    labels = []
    for s in series:
        shown = [f for f in fields if f in varying] or fields[:1]
        if "machine" in fields and "machine" not in shown:
            shown.append("machine")
        parts = [f"{names.get(f, f)}{s.ident[f]}" if names.get(f, f) else str(s.ident[f]) for f in shown]
        labels.append(" ".join(dict.fromkeys(parts)))   # 'naive naive' (backend and impl) once
    return labels


# ---- the layer level ----------------------------------------------------------------------------------------------

def layer_axis(path: Path, axis: str, cases: Sequence[Case], machines: Machines, title: str) -> bool:
    """Time, % read bandwidth and % GEMM peak of the layer against `axis`: a skeleton parameter, with a line per M
    (colour) and experts backend (line style), or the tokens M, with a line per backend (colour) and impl (line
    style)."""
    ok = [c for c in cases if c.status == "ok"]
    oom = [c for c in cases if c.status == "oom"]
    if not ok and not oom:
        return False
    fig, axes = plt.subplots(2, 2, figsize=FIGSIZE, dpi=DPI, layout="constrained")
    t_ax, bw_ax, legend_ax, pk_ax = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]
    # the backend names the impl too (every backend but "naive" is fused): a series is one backend
    series = group_series(ok, [f for f in ("tokens", "backend", "format") if f != axis], axis, machines)
    labels = series_labels(series, {"tokens": "M=", "backend": "", "format": "", "machine": ""})
    colour_of = (lambda s: s.ident["backend"]) if axis == "tokens" else (lambda s: s.ident["tokens"])  # noqa: E731
    style_of = (lambda s: s.cases[0].get("impl")) if axis == "tokens" else (lambda s: s.ident["backend"])  # noqa: E731
    colours = sorted({colour_of(s) for s in series}, key=sort_key)
    styles = list(dict.fromkeys(style_of(s) for s in series))
    for s, label in zip(series, labels):
        style = dict(color=COLORS[colours.index(colour_of(s)) % len(COLORS)],
                     linestyle=LINESTYLES[styles.index(style_of(s)) % len(LINESTYLES)],
                     marker=MARKERS[_other_index(series, s, ("format", "machine")) % len(MARKERS)], markersize=4)
        xs = [c.get(axis) for c in s.cases]
        _curve(t_ax, xs, [c.stat("time_ms") for c in s.cases], label=label, **style)
        _curve(bw_ax, xs, [c.stat("pct_bandwidth") for c in s.cases], **style)
        _curve(pk_ax, xs, [c.stat("pct_peak") for c in s.cases], **style)
    _mark_oom(t_ax, [c.get(axis) for c in oom])
    for ax, ylabel in ((t_ax, "time per layer (ms)"), (bw_ax, "% of read bandwidth"), (pk_ax, "% of GEMM peak")):
        ax.set_xscale("log", base=2)
        ax.set_ylabel(ylabel)
        ax.set_xlabel(AXIS_NAMES[axis])
        ax.grid(True, alpha=0.3)
        _integer_ticks(ax, [c.get(axis) for c in cases])
    t_ax.set_yscale("log")
    _legend_panel(legend_ax, t_ax, title + (" (x: oom)" if oom else ""))
    return _save(fig, path)


def layer_speedup(path: Path, pairs_by_axis: dict[str, list[tuple[Case, Case]]], skeleton: Skeleton,
                  machines: Machines) -> bool:
    """Fused over naive speed-up along each skeleton axis; a line per M (and fused backend, format, machine)."""
    from cpumoe.report.tables import speedup

    drawn = {axis: pairs for axis, pairs in pairs_by_axis.items() if pairs}
    if not drawn:
        return False
    fig, axes = plt.subplots(2, 2, figsize=FIGSIZE, dpi=DPI, layout="constrained")
    for ax, axis in zip(axes.flat, ("inter", "experts", "top_k", "hidden")):
        pairs = drawn.get(axis, [])
        ax.set_title(f"{AXIS_NAMES[axis]}", fontsize=9)
        if not pairs:
            ax.text(0.5, 0.5, "no fused/naive pairs", ha="center", va="center", transform=ax.transAxes, fontsize=8)
            ax.set_axis_off()
            continue
        by_fused = {id(f): n for f, n in pairs}
        series = group_series([f for f, _ in pairs], ("tokens", "backend", "format"), axis, machines)
        labels = series_labels(series, {"tokens": "M=", "backend": "", "format": "", "machine": ""})
        for i, (s, label) in enumerate(zip(series, labels)):
            _curve(ax, [c.get(axis) for c in s.cases], [speedup(c, by_fused[id(c)]) for c in s.cases], label=label,
                   color=COLORS[i % len(COLORS)], marker="o", markersize=4)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        _integer_ticks(ax, [f.get(axis) for f, _ in pairs])
        ax.set_ylabel("naive time / fused time", fontsize=8)
        ax.grid(True, alpha=0.3)
        _legend(ax, fontsize=6)
    fig.suptitle(f"fused vs naive, around {skeleton.describe()}", fontsize=10)
    return _save(fig, path)


# ---- the model level ----------------------------------------------------------------------------------------------

MODEL_SERIES = ("model", "format", "impl", "threads", "layers")
MODEL_NAMES = {"model": "", "format": "", "impl": "", "threads": "threads=", "layers": "layers=", "machine": ""}


def model_batch(path: Path, cases: Sequence[Case], machines: Machines, note: str) -> bool:
    """Throughput against batch size, beside decode % read bandwidth and prefill % GEMM peak."""
    ok = [c for c in cases if c.status == "ok"]
    if not ok:
        return False
    fig, (tp_ax, pct_ax) = plt.subplots(1, 2, figsize=FIGSIZE, dpi=DPI, layout="constrained")
    series = group_series(ok, MODEL_SERIES, "batch", machines)
    for i, (s, label) in enumerate(zip(series, series_labels(series, MODEL_NAMES))):
        xs, color = [c.get("batch") for c in s.cases], COLORS[i % len(COLORS)]
        _curve(tp_ax, xs, [c.stat("throughput_tok_s") for c in s.cases], label=label, color=color, marker="o",
               markersize=4)
        _curve(pct_ax, xs, [c.stat("decode_pct_bandwidth") for c in s.cases], label=f"{label} decode % BW",
               color=color, marker="o", markersize=4)
        _curve(pct_ax, xs, [c.stat("prefill_pct_peak") for c in s.cases], label=f"{label} prefill % peak",
               color=color, marker="s", markersize=4, linestyle="--")
    tp_ax.set_ylabel("throughput: batch x (in + out) / e2e (tok/s)")
    pct_ax.set_ylabel("% of this machine's limit")
    for ax in (tp_ax, pct_ax):
        ax.set_xlabel("batch size")
        ax.set_xscale("log", base=2)
        _integer_ticks(ax, [c.get("batch") for c in ok])
        ax.grid(True, alpha=0.3)
        _legend(ax, fontsize=7)
    fig.suptitle(note, fontsize=10)
    return _save(fig, path)


def model_length(path: Path, axis: str, cases: Sequence[Case], machines: Machines, note: str) -> bool:
    """TTFT and ITL against input or output length, with prefill % GEMM peak and decode % read bandwidth."""
    ok = [c for c in cases if c.status == "ok"]
    if not ok:
        return False
    fig, axes = plt.subplots(2, 2, figsize=FIGSIZE, dpi=DPI, layout="constrained")
    panels = (("ttft_ms", "TTFT (ms)"), ("itl_ms", "ITL (ms)"), ("prefill_pct_peak", "prefill % of GEMM peak"),
              ("decode_pct_bandwidth", "decode % of read BW"))
    series = group_series(ok, MODEL_SERIES, axis, machines)
    labels = series_labels(series, MODEL_NAMES)
    for ax, (metric, ylabel) in zip(axes.flat, panels):
        for i, (s, label) in enumerate(zip(series, labels)):
            _curve(ax, [c.get(axis) for c in s.cases], [c.stat(metric) for c in s.cases], label=label,
                   color=COLORS[i % len(COLORS)], marker="o", markersize=4)
        ax.set_xscale("log", base=2)
        _integer_ticks(ax, [c.get(axis) for c in ok])
        ax.set_xlabel(AXIS_NAMES[axis], fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(True, alpha=0.3)
    _legend(axes[0, 0], fontsize=7)
    fig.suptitle(note, fontsize=10)
    return _save(fig, path)


# ---- serving ------------------------------------------------------------------------------------------------------

SERVE_FIELDS = ("label", "model", "endpoint", "dataset", "input_len", "output_len", "num_prompts", "burstiness",
                "request_rate", "max_concurrency")
SERVE_NAMES = {"label": "", "model": "", "machine": "", "max_concurrency": "conc=", "request_rate": "rate=",
               "input_len": "in=", "output_len": "out="}
UNBOUNDED = {"request_rate": "inf", "max_concurrency": "none"}   # how the right end of each axis is labelled


def serve_load(path: Path, axis: str, cases: Sequence[Case], machines: Machines) -> bool:
    """TTFT, TPOT and ITL p50/p90/p99 and throughput against the request rate or the concurrency limit; an
    unbounded value ('inf' rate, no limit) is drawn at the right end."""
    ok = [c for c in cases if c.status == "ok"]
    if not ok:
        return False
    finite = [float(c.get(axis)) for c in ok if _is_rate(c.get(axis))]
    end_x = max(finite) * 2 if finite else 1.0
    xpos = lambda value: float(value) if _is_rate(value) else end_x  # noqa: E731
    fig, axes = plt.subplots(2, 2, figsize=FIGSIZE, dpi=DPI, layout="constrained")
    series = group_series(ok, [f for f in SERVE_FIELDS if f != axis], axis, machines)
    labels = series_labels(series, SERVE_NAMES)
    for ax, what in zip(axes.flat, ("ttft", "tpot", "itl")):
        for i, (s, label) in enumerate(zip(series, labels)):
            xs = [xpos(c.get(axis)) for c in s.cases]
            for (key, name), ls in zip((("median", "p50"), ("p90", "p90"), ("p99", "p99")), LINESTYLES):
                _curve(ax, xs, [c.stat(f"{key}_{what}_ms") for c in s.cases], label=label if key == "median" else None,
                       color=COLORS[i % len(COLORS)], linestyle=ls, marker="o", markersize=3)
        ax.set_ylabel(f"{what.upper()} (ms)", fontsize=8)
    tp_ax = axes[1, 1]
    for i, (s, label) in enumerate(zip(series, labels)):
        xs = [xpos(c.get(axis)) for c in s.cases]
        _curve(tp_ax, xs, [c.stat("output_throughput") for c in s.cases], color=COLORS[i % len(COLORS)],
               marker="o", markersize=3)
        _curve(tp_ax, xs, [c.stat("total_token_throughput") for c in s.cases], color=COLORS[i % len(COLORS)],
               marker="s", markersize=3, linestyle="--")
    tp_ax.set_ylabel("tok/s (solid output, dashed total)", fontsize=8)
    ticks = sorted({xpos(c.get(axis)) for c in ok})
    unbounded = any(not _is_rate(c.get(axis)) for c in ok)
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [UNBOUNDED[axis] if unbounded and t == end_x else f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel(AXIS_NAMES[axis], fontsize=8)
        ax.grid(True, alpha=0.3)
    _legend(axes[0, 0], fontsize=6)
    fig.suptitle("latency: solid p50, dashed p90, dotted p99", fontsize=9)
    return _save(fig, path)


# ---- routing and pruning ------------------------------------------------------------------------------------------

def experts_heatmap(path: Path, case: Case, title: str) -> bool:
    """Tokens routed to each expert of each layer (counts [L, E]) as a heatmap."""
    counts = case.series("counts")  # [L][E]
    if not counts or not any(counts):
        return False
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    image = ax.imshow([[v if v is not None else math.nan for v in layer] for layer in counts], aspect="auto",
                      cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="tokens routed")
    ax.set_xlabel("expert")
    layers = case.series("layers")   # the decoder layer of each MoE layer (a dense first layer is not counted)
    if layers and len(layers) == len(counts):
        step = max(1, len(layers) // 16)
        ax.set_yticks(range(0, len(layers), step), [str(v) for v in layers[::step]])
        ax.set_ylabel("decoder layer")
    else:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("MoE layer")
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def experts_distinct(path: Path, cases: Sequence[Case], machines: Machines) -> bool:
    """Distinct experts a batch touches against batch size: measured beside what uniform routing would give."""
    drawn = [c for c in cases if c.status == "ok" and c.series("distinct_batches")]
    if not drawn:
        return False
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    for i, case in enumerate(drawn):
        label = f"{case.get('model')} {case.get('prompts')}" + (f" {machines.label(case.machine)}"
                                                                if machines.several else "")
        xs = case.series("distinct_batches")
        color = COLORS[i % len(COLORS)]
        _curve(ax, xs, case.series_stat("distinct_measured") or [], label=f"{label} measured", color=color,
               marker="o", markersize=4)
        _curve(ax, xs, case.series_stat("distinct_uniform") or [], label=f"{label} uniform", color=color,
               linestyle="--")
    ax.set_xscale("log", base=2)
    _integer_ticks(ax, [x for c in drawn for x in c.series("distinct_batches")])
    ax.set_xlabel("batch (tokens)")
    ax.set_ylabel("distinct experts per layer")
    ax.grid(True, alpha=0.3)
    _legend(ax, fontsize=7)
    return _save(fig, path)


def prune_tradeoff(path: Path, cases: Sequence[Case], machines: Machines) -> bool:
    """Quality (perplexity, top-1 agreement) against decode and prefill speed-up, a line per method."""
    ok = [c for c in cases if c.status == "ok"]
    if not ok:
        return False
    fig, axes = plt.subplots(2, 2, figsize=FIGSIZE, dpi=DPI, layout="constrained")
    series = group_series(ok, ("model", "method"), "ratio", machines)
    labels = series_labels(series, {"model": "", "method": "", "machine": ""})
    for (row, speed), (col, quality) in [(r, q) for r in enumerate(("speedup_decode", "speedup_prefill"))
                                         for q in enumerate(("perplexity", "top1_agreement"))]:
        ax = axes[row, col]
        for i, (s, label) in enumerate(zip(series, labels)):
            baseline = s.ident["method"] == "none"
            _curve(ax, [c.stat(speed) for c in s.cases], [c.stat(quality) for c in s.cases], label=label,
                   color="black" if baseline else COLORS[i % len(COLORS)], marker="*" if baseline else "o",
                   markersize=9 if baseline else 4, annotate=[c.get("ratio") for c in s.cases])
        ax.set_xlabel(speed.replace("speedup_", "") + " speed-up", fontsize=8)
        ax.set_ylabel(quality.replace("top1_", "top-1 "), fontsize=8)
        ax.grid(True, alpha=0.3)
    _legend(axes[0, 0], fontsize=7)
    fig.suptitle("pruning: quality against speed-up (points labelled with the ratio)", fontsize=10)
    return _save(fig, path)


# ---- drawing ------------------------------------------------------------------------------------------------------

def _curve(ax, xs: Sequence[Any], ys: Sequence[Stat | None], annotate: Sequence[Any] | None = None,
           **style) -> None:
    """Medians joined by a line, each with an error bar over its runs; x may be numbers or Stats."""
    points = [(x, y, a) for x, y, a in zip(xs, ys, annotate or [None] * len(xs))
              if y is not None and x is not None]
    if not points:
        return
    px = [x.median if isinstance(x, Stat) else float(x) for x, _, _ in points]
    py = [y.median for _, y, _ in points]
    yerr = [[y.median - y.lo for _, y, _ in points], [y.hi - y.median for _, y, _ in points]]
    xerr = None
    if any(isinstance(x, Stat) for x, _, _ in points):
        xerr = [[x.median - x.lo if isinstance(x, Stat) else 0 for x, _, _ in points],
                [x.hi - x.median if isinstance(x, Stat) else 0 for x, _, _ in points]]
    ax.errorbar(px, py, yerr=yerr, xerr=xerr, capsize=2, elinewidth=0.8, linewidth=1.2, **style)
    for x, y, (_, _, note) in zip(px, py, points):
        if note is not None:
            ax.annotate(f"{note:g}" if isinstance(note, float) else str(note), (x, y), fontsize=6,
                        textcoords="offset points", xytext=(3, 3))


def _mark_oom(ax, xs: Sequence[Any]) -> None:
    """A red cross at the top of the panel for each x that would not fit this machine."""
    transform = blended_transform_factory(ax.transData, ax.transAxes)
    for x in sorted({float(x) for x in xs if x is not None}):
        ax.plot([x], [0.92], marker="x", color="red", markersize=9, markeredgewidth=2, transform=transform,
                clip_on=False, linestyle="none")
        ax.text(x, 0.8, "oom", color="red", fontsize=8, ha="center", transform=transform)


def _legend(ax, **kwargs) -> None:
    """A legend where the panel has labelled curves (a panel may have none: rows without its metric)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def _legend_panel(legend_ax, source_ax, title: str) -> None:
    legend_ax.set_axis_off()
    handles, labels = source_ax.get_legend_handles_labels()
    legend_ax.legend(handles, labels, loc="center", fontsize=7, ncol=2 if len(labels) > 6 else 1, title=title,
                     title_fontsize=8, frameon=False)


def _integer_ticks(ax, values: Sequence[Any]) -> None:
    ticks = sorted({float(v) for v in values if isinstance(v, (int, float)) and v > 0})
    if ticks:
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
        ax.minorticks_off()


def _other_index(series: Sequence[Series], s: Series, fields: Sequence[str]) -> int:
    values = list(dict.fromkeys(tuple(x.ident.get(f) for f in fields) for x in series))
    return values.index(tuple(s.ident.get(f) for f in fields))


def _is_rate(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def sort_key(value: Any) -> tuple:
    """A sort key that puts numbers in order and anything else ('inf', None) after them."""
    return (0, float(value)) if _is_rate(value) else (1, str(value))


def _save(fig, path: Path) -> bool:
    """The figure as a 256-colour PNG (a third of the bytes of matplotlib's RGBA, the same to the eye); nothing
    when no panel got a point (rows without the metrics it draws)."""
    if not any(ax.containers or ax.images for ax in fig.axes):
        plt.close(fig)
        return False
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png")
    plt.close(fig)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return True
