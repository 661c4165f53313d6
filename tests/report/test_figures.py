"""Each figure function: a PNG of 800 x 500 px and a few tens of kB when it has cases, no file when it has none."""
import struct

import pytest

from cpumoe.bench.results import ResultsDB
from cpumoe.report import figures
from cpumoe.report.build import _fused_naive_pairs
from cpumoe.report.cases import Machines, Skeleton, group_cases, on_axis

from .conftest import SKELETON


@pytest.fixture(scope="module")
def study(study_db):
    with ResultsDB(study_db) as db:
        rows = db.rows()
    cases = group_cases(rows)
    by_bench = {}
    for case in cases:
        by_bench.setdefault(case.bench, []).append(case)
    return by_bench, Machines.of(rows)


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    return struct.unpack(">II", data[16:24])


def assert_small_png(path):
    assert path.exists(), f"{path.name} was not written"
    assert png_size(path) == (800, 500), f"{path.name} is {png_size(path)}"
    assert 3_000 < path.stat().st_size < 150_000, f"{path.name} is {path.stat().st_size} bytes"


def test_layer_axis_figures(study, tmp_path):
    by_bench, machines = study
    skeleton = Skeleton(**SKELETON)
    for axis in ("inter", "experts", "top_k", "hidden"):
        path = tmp_path / f"{axis}.png"
        assert figures.layer_axis(path, axis, on_axis(by_bench["layer"], skeleton, axis), machines, title=axis)
        assert_small_png(path)
    at_skeleton = [c for c in by_bench["layer"] if all(c.get(k) == v for k, v in SKELETON.items())]
    assert figures.layer_axis(tmp_path / "tokens.png", "tokens", at_skeleton, machines, title="M")
    assert_small_png(tmp_path / "tokens.png")
    assert not figures.layer_axis(tmp_path / "none.png", "inter", [], machines, title="")
    assert not (tmp_path / "none.png").exists()


def test_layer_speedup_figure(study, tmp_path):
    by_bench, machines = study
    skeleton = Skeleton(**SKELETON)
    pairs = _fused_naive_pairs(by_bench["layer"])
    by_axis = {a: [p for p in pairs if p[0] in on_axis(by_bench["layer"], skeleton, a)] for a in ("inter", "top_k")}
    assert figures.layer_speedup(tmp_path / "s.png", by_axis, skeleton, machines)
    assert_small_png(tmp_path / "s.png")
    assert not figures.layer_speedup(tmp_path / "none.png", {"inter": []}, skeleton, machines)


def test_model_figures(study, tmp_path):
    by_bench, machines = study
    model = by_bench["model"]
    assert figures.model_batch(tmp_path / "b.png", [c for c in model if c.get("input_len") == 128
                                                    and c.get("output_len") == 128], machines, note="in 128")
    assert_small_png(tmp_path / "b.png")
    for axis in ("input_len", "output_len"):
        assert figures.model_length(tmp_path / f"{axis}.png", axis, [c for c in model if c.get("batch") == 1],
                                    machines, note="batch 1")
        assert_small_png(tmp_path / f"{axis}.png")
    assert not figures.model_batch(tmp_path / "none.png", [], machines, note="")
    assert not figures.model_length(tmp_path / "none.png", "input_len", [], machines, note="")


def test_serve_experts_and_prune_figures(study, tmp_path):
    by_bench, machines = study
    assert figures.serve_load(tmp_path / "serve.png", "request_rate", by_bench["serve"], machines)
    assert figures.serve_load(tmp_path / "conc.png", "max_concurrency", by_bench["serve"], machines)
    assert figures.experts_heatmap(tmp_path / "heat.png", by_bench["experts"][0], title="counts")
    assert figures.experts_distinct(tmp_path / "distinct.png", by_bench["experts"], machines)
    assert figures.prune_tradeoff(tmp_path / "prune.png", by_bench["prune"], machines)
    for name in ("serve", "conc", "heat", "distinct", "prune"):
        assert_small_png(tmp_path / f"{name}.png")
    assert not figures.serve_load(tmp_path / "none.png", "request_rate", [], machines)
    assert not figures.experts_distinct(tmp_path / "none.png", [], machines)
    assert not figures.prune_tradeoff(tmp_path / "none.png", [], machines)
    assert not (tmp_path / "none.png").exists()


def test_series_are_split_by_machine_and_named_by_what_differs(study):
    by_bench, machines = study
    skeleton_cases = [c for c in by_bench["layer"] if all(c.get(k) == v for k, v in SKELETON.items())
                      and c.get("tokens") == 1 and c.get("impl") == "fused"]
    series = figures.group_series(skeleton_cases, ("tokens", "impl"), "inter", machines)
    assert len(series) == 2
    assert figures.series_labels(series, {"tokens": "M=", "impl": "", "machine": ""}) == ["M1", "M2"]
    serve = figures.group_series(by_bench["serve"], ("label", "max_concurrency"), "request_rate", machines)
    assert [c.get("request_rate") for c in serve[0].cases] == [1, 2, 4, 8, "inf"]
    assert figures.series_labels(serve, figures.SERVE_NAMES) == [
        "cpumoe conc=None M1", "vllm-cpu conc=None M1", "cpumoe conc=1 M1", "cpumoe conc=4 M1", "cpumoe conc=16 M1"]
