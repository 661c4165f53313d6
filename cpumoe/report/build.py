"""A results database's rows -> the report: sections of figures (drawn to PNG files) and the tables under them.

    rows -> cases (repeats folded, machines kept apart) -> the machines, then one Section per bench:
        layer    time vs tokens M; one figure per skeleton axis (inter, experts, top_k, hidden); fused vs naive
        model    throughput vs batch, TTFT/ITL vs input length and vs output length
        serve    latency percentiles and throughput vs request rate, and vs concurrency limit
        experts  a layer x expert heatmap per case, distinct experts vs batch
        prune    quality vs speed-up per method
        other    any other bench: its cases as a table
Under each figure, a table of the cases it draws; each bench ends with a table of every case. A figure is drawn
only when its rows exist; a bench without rows gets a section that says so. page.py and export.py render the
Report; nothing here writes text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from cpumoe.bench.results import Row, case_key
from cpumoe.report import figures, tables
from cpumoe.report.cases import LAYER_AXES, Case, Machines, Skeleton, group_cases, most_common_values, on_axis
from cpumoe.report.tables import Table

FIGURES_DIR = "figures"   # under the output directory; the page refers to the PNGs relatively

# The benches the page knows how to draw, in page order, with the command that writes their rows.
KNOWN_BENCHES = {"layer": "cpumoe bench layer / cpumoe bench sweep", "model": "cpumoe bench model / cpumoe bench sweep",
                 "serve": "cpumoe bench serve", "experts": "cpumoe bench experts", "prune": "cpumoe bench prune"}


@dataclass(slots=True)
class Figure:
    file: str        # relative to the page: figures/<name>.png
    alt: str


@dataclass(slots=True)
class Block:
    title: str
    text: str = ""
    figure: Figure | None = None
    tables: list[Table] = field(default_factory=list)


@dataclass(slots=True)
class Section:
    id: str
    title: str
    text: str = ""
    blocks: list[Block] = field(default_factory=list)


@dataclass(slots=True)
class Report:
    source: str                 # the database it was drawn from
    rows: int
    machines: Machines
    sections: list[Section]

    def tables(self) -> list[Table]:
        return [t for s in self.sections for b in s.blocks for t in b.tables]

    def figures(self) -> list[Figure]:
        return [b.figure for s in self.sections for b in s.blocks if b.figure is not None]


def build_report(rows: Sequence[Row], out_dir: Path, source: str, skeleton: Skeleton | None = None) -> Report:
    """Draw every figure the rows allow into out_dir/figures and return the page's sections."""
    fig_dir = out_dir / FIGURES_DIR
    fig_dir.mkdir(parents=True, exist_ok=True)
    machines = Machines.of(rows)
    cases = group_cases(rows)
    by_bench: dict[str, list[Case]] = {}
    for case in cases:
        by_bench.setdefault(case.bench, []).append(case)
    if not rows:
        return Report(source=source, rows=0, machines=machines, sections=[])

    draw = _Drawer(fig_dir)
    sections = [_machine_section(machines)]
    builders = {"layer": lambda cs: _layer_section(cs, machines, draw, skeleton),
                "model": lambda cs: _model_section(cs, machines, draw),
                "serve": lambda cs: _serve_section(cs, machines, draw),
                "experts": lambda cs: _experts_section(cs, machines, draw),
                "prune": lambda cs: _prune_section(cs, machines, draw)}
    for bench, command in KNOWN_BENCHES.items():
        if by_bench.get(bench):
            sections.append(builders[bench](by_bench[bench]))
        else:
            sections.append(Section(id=bench, title=_TITLES[bench],
                                    text=f"No rows for this bench in the database (written by `{command}`)."))
    for bench in sorted(set(by_bench) - set(KNOWN_BENCHES)):
        bench_cases = by_bench[bench]
        sections.append(Section(id=f"bench-{_slug(bench)}", title=f"Other bench: {bench}", blocks=[Block(
            title=f"{bench}: every case", tables=[Table.of(f"{_slug(bench)}-all", f"{bench}: every case",
                                                           tables.generic_columns(bench_cases, machines),
                                                           bench_cases)])]))
    return Report(source=source, rows=len(rows), machines=machines, sections=sections)


_TITLES = {"layer": "MoE layer (kernel level)", "model": "Model (offline engine)", "serve": "Serving under load",
           "experts": "Expert routing", "prune": "Pruning"}


class _Drawer:
    """Calls a figure function with the PNG path of a name, and returns the Figure when it drew one."""

    def __init__(self, fig_dir: Path) -> None:
        self.fig_dir = fig_dir

    def __call__(self, name: str, alt: str, function, *args, **kwargs) -> Figure | None:
        if function(self.fig_dir / f"{name}.png", *args, **kwargs):
            return Figure(file=f"{FIGURES_DIR}/{name}.png", alt=alt)
        return None


def _machine_section(machines: Machines) -> Section:
    text = ("Every figure is read against the limits its own runs measured: the streaming read bandwidth (GB/s) "
            "and the GEMM rate (GFLOP/s) stored with each row; ranges are over the runs.")
    if machines.several:
        text += " The database holds rows from several machines: their curves are drawn apart and labelled M1, M2, ..."
    return Section(id="machine", title="Machine", text=text,
                   blocks=[Block(title="Machines", tables=[tables.machines_table(machines)])])


def _layer_section(cases: list[Case], machines: Machines, draw: _Drawer, skeleton: Skeleton | None) -> Section:
    given = skeleton is not None
    skeleton = skeleton or Skeleton.most_common(cases)
    columns = tables.layer_columns(machines)
    section = Section(id="layer", title=_TITLES["layer"])
    if skeleton is None:
        section.text = "The layer rows carry no (hidden, inter, experts, top_k): only the table of every case is drawn."
        section.blocks.append(_every_layer_case(cases, columns))
        return section
    origin = "given with --skeleton" if given else "the most common shape among the rows"
    section.text = (f"Skeleton {skeleton.describe()} ({origin}). Against the tokens M: a line per experts backend "
                    "(naive dashed); against a skeleton parameter (the paper's sweeps, the other three kept at the "
                    "skeleton's): a line per M (colour) and experts backend (line style); a red cross marks a case "
                    "that would not fit this machine (oom). Beside the time: the layer's achieved GB/s as % of the "
                    "read bandwidth and its GFLOP/s as % of the GEMM rate its runs measured.")
    swept = {axis: sorted(on_axis(cases, skeleton, axis), key=lambda c: _order(c, (axis, "tokens", "impl")))
             for axis in LAYER_AXES}
    swept = {axis: points for axis, points in swept.items() if len({c.get(axis) for c in points}) > 1}
    # Against M: the skeleton when the rows hold sweeps, else every shape (plain `cpumoe bench layer` runs).
    shapes = [skeleton] if swept else list(dict.fromkeys(_shape(c) for c in cases if _shape(c) is not None))
    for i, shape in enumerate(shapes, start=1):
        points = sorted([c for c in cases if _shape(c) == shape],
                        key=lambda c: _order(c, ("format", "impl", "backend", "tokens")))
        if len({c.get("tokens") for c in points}) < 2:
            continue
        presets = ", ".join(dict.fromkeys(str(c.get("preset")) for c in points))
        section.blocks.append(Block(
            title=f"Against tokens M: {presets}, {shape.describe()}",
            figure=draw(f"layer-tokens-{i}", f"layer time and % of limits against M, {shape.describe()}",
                        figures.layer_axis, "tokens", points, machines, title=f"{presets}, {shape.describe()}"),
            tables=[Table.of(f"layer-tokens-{i}", f"Layer cases of {shape.describe()}", columns, points)]))
    for axis in LAYER_AXES:
        if axis not in swept:
            section.blocks.append(Block(title=_sentence(figures.AXIS_NAMES[axis]),
                                        text=f"No rows vary {axis} around the skeleton."))
            continue
        section.blocks.append(Block(
            title=_sentence(figures.AXIS_NAMES[axis]),
            figure=draw(f"layer-{axis}", f"layer time and % of limits against {axis}", figures.layer_axis, axis,
                        swept[axis], machines, title=f"{skeleton.describe()}, {axis} varied"),
            tables=[Table.of(f"layer-{axis}", f"Layer cases along {axis} ({skeleton.describe()} otherwise)",
                             columns, swept[axis])]))
    pairs = _fused_naive_pairs(cases)
    if pairs:
        pair_axes = {axis: [p for p in pairs if p[0] in points] for axis, points in swept.items()}
        section.blocks.append(Block(
            title="Fused vs naive",
            text="Speed-up = naive time / fused time for the same shape, format, M and machine.",
            figure=draw("layer-speedup", "fused over naive speed-up", figures.layer_speedup,
                        {a: p for a, p in pair_axes.items() if len({f.get(a) for f, _ in p}) > 1}, skeleton,
                        machines),
            tables=[tables.speedup_table("layer-speedup", "Fused vs naive: every pair", pairs, machines)]))
    section.blocks.append(_every_layer_case(cases, columns))
    return section


def _every_layer_case(cases: list[Case], columns) -> Block:
    return Block(title="Every layer case", tables=[Table.of("layer-all", "Layer: every case", columns, cases)])


def _shape(case: Case) -> Skeleton | None:
    values = [case.get(a) for a in ("hidden", "inter", "experts", "top_k")]
    return Skeleton(*values) if all(isinstance(v, int) for v in values) else None


def _fused_naive_pairs(cases: list[Case]) -> list[tuple[Case, Case]]:
    """(fused, naive) cases equal in every parameter but impl and backend, on the same machine."""
    def key(case: Case) -> tuple[str, str]:
        rest = {k: v for k, v in case.params.items() if k not in ("impl", "backend")}
        return case_key(rest), case.machine

    naive = {key(c): c for c in cases if c.get("impl") == "naive" and c.status == "ok"}
    return [(c, naive[key(c)]) for c in cases if c.get("impl") == "fused" and c.status == "ok" and key(c) in naive]


def _model_section(cases: list[Case], machines: Machines, draw: _Drawer) -> Section:
    batch, in_len, out_len = most_common_values(cases, ("batch", "input_len", "output_len"))
    columns = tables.model_columns(machines)
    section = Section(id="model", title=_TITLES["model"], text=(
        f"The sweeps vary one of batch, input and output length around the most common case (batch {batch}, "
        f"input {in_len}, output {out_len}). Throughput = batch x (in + out) / e2e; ITL = (e2e - TTFT) / (batch x "
        "(out - 1)), as the paper defines them. Beside them: decode GB/s as % of the read bandwidth and prefill "
        "GFLOP/s as % of the GEMM rate the same runs measured."))
    axes = (("batch", {"input_len": in_len, "output_len": out_len}, "throughput against batch size",
             f"input {in_len}, output {out_len}"),
            ("input_len", {"batch": batch, "output_len": out_len}, "TTFT and ITL against input length",
             f"batch {batch}, output {out_len}"),
            ("output_len", {"batch": batch, "input_len": in_len}, "TTFT and ITL against output length",
             f"batch {batch}, input {in_len}"))
    for axis, fixed, title, note in axes:
        points = sorted([c for c in cases if all(c.get(k) == v for k, v in fixed.items())],
                        key=lambda c: _order(c, ("model", "impl", axis)))
        if len({c.get(axis) for c in points}) < 2:
            section.blocks.append(Block(title=_sentence(title), text=f"No rows vary {axis} at {note}."))
            continue
        function = figures.model_batch if axis == "batch" else figures.model_length
        extra = () if axis == "batch" else (axis,)
        section.blocks.append(Block(
            title=_sentence(title),
            figure=draw(f"model-{axis}", title, function, *extra, points, machines, note=note),
            tables=[Table.of(f"model-{axis}", f"Model cases along {axis} ({note})", columns, points)]))
    section.blocks.append(Block(title="Every model case", tables=[Table.of("model-all", "Model: every case", columns,
                                                                           cases)]))
    return section


def _serve_section(cases: list[Case], machines: Machines, draw: _Drawer) -> Section:
    columns = tables.serve_columns(machines)
    section = Section(id="serve", title=_TITLES["serve"], text=(
        "Latency percentiles (solid p50, dashed p90, dotted p99) and throughput against the request rate ('inf' "
        "sends every request at once) and against the concurrency limit ('none': no limit). A figure draws the runs "
        "that differ only in its x; a run alone is in the table of every case. Metrics as "
        "`vllm bench serve --save-result` writes them."))
    for axis, title in (("request_rate", "Latency and throughput against request rate"),
                        ("max_concurrency", "Latency and throughput against concurrency")):
        groups: dict[tuple, list[Case]] = {}
        for case in cases:
            key = (case.machine, *(case_key({"v": case.get(f)}) for f in figures.SERVE_FIELDS if f != axis))
            groups.setdefault(key, []).append(case)
        points = sorted([c for group in groups.values() if len({repr(c.get(axis)) for c in group}) > 1 for c in group],
                        key=lambda c: _order(c, (*figures.SERVE_FIELDS, axis)))
        if not points:
            section.blocks.append(Block(title=title, text=f"No runs differ only in {axis}."))
            continue
        section.blocks.append(Block(
            title=title, figure=draw(f"serve-{axis}", title.lower(), figures.serve_load, axis, points, machines),
            tables=[Table.of(f"serve-{axis}", f"Serving: runs along {axis}", columns, points)]))
    ordered = sorted(cases, key=lambda c: _order(c, figures.SERVE_FIELDS))
    section.blocks.append(Block(title="Every serving run", tables=[Table.of("serve-all", "Serving: every run", columns,
                                                                           ordered)]))
    return section


def _experts_section(cases: list[Case], machines: Machines, draw: _Drawer) -> Section:
    section = Section(id="experts", title=_TITLES["experts"], text=(
        "How many tokens each layer sent to each expert; max/mean, coefficient of variation and entropy of the "
        "load per layer; experts never chosen; and how many distinct experts a batch touches, measured and if "
        "routing were uniform (what decides the bytes a decode step reads)."))
    for i, case in enumerate(cases, start=1):
        name = f"{case.get('model')}, prompts {case.get('prompts')}, {case.get('tokens')} tokens" + (
            f", {machines.label(case.machine)}" if machines.several else "")
        if case.status != "ok":
            section.blocks.append(Block(title=name, text=f"{case.status}: {case.message()}"))
            continue
        section.blocks.append(Block(
            title=name, figure=draw(f"experts-{i}", f"tokens per layer and expert: {name}", figures.experts_heatmap,
                                    case, title=f"tokens per layer and expert: {name}"),
            tables=[tables.experts_layer_table(f"experts-{i}", f"Per layer: {name}", case)]))
    distinct = [c for c in cases if c.status == "ok" and c.series("distinct_batches")]
    if distinct:
        section.blocks.append(Block(
            title="Distinct experts per batch",
            figure=draw("experts-distinct", "distinct experts against batch size", figures.experts_distinct, distinct,
                        machines),
            tables=[tables.experts_distinct_table("experts-distinct", "Distinct experts per batch", distinct,
                                                  machines)]))
    return section


def _prune_section(cases: list[Case], machines: Machines, draw: _Drawer) -> Section:
    # the unpruned baseline first, then each method by ratio
    ordered = sorted(cases, key=lambda c: (c.get("method") != "none", _order(c, ("model", "method", "ratio"))))
    return Section(id="prune", title=_TITLES["prune"], text=(
        "Inter-expert pruning drops experts (and their router rows), intra-expert pruning shrinks each expert's I; "
        "quality against the unpruned model ('none', the star) beside the decode and prefill speed-up."),
        blocks=[Block(title="Quality against speed-up",
                      figure=draw("prune-tradeoff", "pruning quality against speed-up", figures.prune_tradeoff,
                                  ordered, machines),
                      tables=[Table.of("prune-all", "Pruning: every case", tables.prune_columns(machines),
                                       ordered)])])


def _order(case: Case, keys: Sequence[str]) -> tuple:
    """Sort cases by these parameters: numbers in order, then anything else as text."""
    return tuple(figures.sort_key(case.get(k)) for k in keys)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text.lower()).strip("-") or "bench"
