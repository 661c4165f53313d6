"""Rows folded into cases: repeats as median and range, machines apart, the skeleton and its axes."""
import pytest

from cpumoe.bench.results import ResultsDB
from cpumoe.report.cases import Machines, Skeleton, Stat, group_cases, most_common_values, on_axis

from .conftest import OTHER_MACHINE, SKELETON, layer_case


@pytest.fixture(scope="module")
def study(study_db):
    with ResultsDB(study_db) as db:
        rows = db.rows()
    return rows, group_cases(rows), Machines.of(rows)


def test_stat_is_median_and_range_and_skips_missing():
    s = Stat.of([3.0, None, 1.0, 2.0, "text", float("nan")])
    assert (s.median, s.lo, s.hi, s.n) == (2.0, 1.0, 3.0, 3) and s.spread
    assert Stat.of([None]) is None
    assert not Stat.of([5.0]).spread


def test_repeats_fold_into_one_case_with_their_range(study):
    rows, cases, machines = study
    key = layer_case(SKELETON, 16, "fused")
    (case,) = [c for c in cases if c.bench == "layer" and c.params == key and c.machine == rows[0].machine]
    times = [r.metrics["time_ms"] for r in rows if r.bench == "layer" and r.case == key and r.machine == case.machine]
    assert case.runs == 3 and len(times) == 3
    s = case.stat("time_ms")
    assert s.n == 3 and s.lo == min(times) and s.hi == max(times) and s.median == sorted(times)[1]
    assert case.limit("bandwidth_gbs").n == 3


def test_machines_are_never_mixed(study):
    rows, cases, machines = study
    assert len(machines) == 2 and machines.several
    other = [m for m in machines if m.info == OTHER_MACHINE]
    assert len(other) == 1 and other[0].label == "M2" and other[0].rows == 2
    skeleton_m1 = [c for c in cases if c.bench == "layer" and c.params == layer_case(SKELETON, 1, "fused")]
    assert sorted(c.runs for c in skeleton_m1) == [2, 3]     # one case per machine
    assert other[0].bandwidth.median == 20.0


def test_missing_percentages_come_from_the_runs_limits(study):
    rows, cases, machines = study
    other = next(m for m in machines if m.info == OTHER_MACHINE).fingerprint
    (case,) = [c for c in cases if c.machine == other]
    assert "pct_bandwidth" not in case.rows[0].metrics
    gbs = case.stat("gbs").median
    assert case.stat("pct_bandwidth").median == pytest.approx(100 * gbs / 20.0)
    assert case.stat("pct_peak").median == pytest.approx(100 * case.stat("gflops").median / 300.0)


def test_oom_and_error_cases_keep_their_status_and_reason(study):
    _, cases, _ = study
    oom = [c for c in cases if c.status == "oom"]
    assert len(oom) == 8 and all(c.get("experts") == 64 for c in oom)
    assert "needs 22.5 GiB, 20.0 GiB available" == oom[0].message()
    (error,) = [c for c in cases if c.status == "error"]
    assert error.message() == "no backend takes int8 here" and error.stat("time_ms") is None


def test_layer_rows_that_say_path_are_read_as_backend(tmp_path):
    """Older databases' layer rows say "path": they fold into the same case as rows that say "backend"."""
    new = layer_case(SKELETON, 1, "fused")
    old = {("path" if k == "backend" else k): v for k, v in new.items()}
    with ResultsDB(tmp_path / "old.db") as db:
        db.add("layer", old, {"time_ms": 2.0})
        db.add("layer", new, {"time_ms": 1.0})
        rows = db.rows()
    (case,) = group_cases(rows)
    assert case.params == new and case.runs == 2
    assert case.stat("time_ms").median == 1.5


def test_skeleton_is_the_most_common_shape_and_axes_vary_one_parameter(study):
    _, cases, _ = study
    layer = [c for c in cases if c.bench == "layer"]
    skeleton = Skeleton.most_common(layer)
    assert skeleton == Skeleton(**SKELETON)
    inter = on_axis(layer, skeleton, "inter")
    assert sorted({c.get("inter") for c in inter}) == [1792, 3584, 7168, 14336]
    assert all((c.get("hidden"), c.get("experts"), c.get("top_k")) == (4096, 8, 2) for c in inter)
    assert sorted({c.get("experts") for c in on_axis(layer, skeleton, "experts")}) == [8, 16, 32, 64]
    assert sorted({c.get("hidden") for c in on_axis(layer, skeleton, "hidden")}) == [2048, 4096]
    assert [c.get("top_k") for c in on_axis(layer, Skeleton(2048, 14336, 8, 2), "top_k")] == [2] * 8


def test_skeleton_parse_refuses_bad_text():
    assert Skeleton.parse("4096, 14336,8,2") == Skeleton(4096, 14336, 8, 2)
    for bad in ("4096,14336,8", "a,b,c,d", "4096,14336,8,0", ""):
        with pytest.raises(ValueError, match="four positive integers"):
            Skeleton.parse(bad)


def test_model_base_is_the_most_common_point(study):
    _, cases, _ = study
    assert most_common_values([c for c in cases if c.bench == "model"], ("batch", "input_len", "output_len")) == (
        1, 128, 128)


def test_list_metrics_fold_element_wise(study):
    _, cases, _ = study
    case = next(c for c in cases if c.bench == "experts")
    counts = case.series("counts")
    assert len(counts) == 4 and len(counts[0]) == 128 and counts == case.rows[0].metrics["counts"]
    assert [s.median for s in case.series_stat("distinct_measured")] == [8, 60, 85, 105]
