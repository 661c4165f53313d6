"""`cpumoe bench sweep layer` on tiny shapes: rows per the `layer` contract, resume by skipping, oom before running,
error rows, the paper grid's memory verdicts, and bad flags."""
import json

import pytest

from cpumoe.bench.results import ResultsDB, case_key
from cpumoe.bench.sweep.cases import LayerUnit
from cpumoe.bench.sweep.grid import Shape, arch_shapes, get_grid
from cpumoe.bench.sweep.memory import MemoryPolicy
from cpumoe.bench.sweep.plan import RunOptions, layer_units
from cpumoe.bench.sweep.runner import pending_units, run_sweep
from cpumoe.cli import main
from cpumoe.presets import get_preset

LAYER_CASE = {"preset", "hidden", "inter", "experts", "top_k", "format", "backend", "impl", "tokens", "threads"}
LAYER_METRICS = {"time_ms", "time_ms_min", "time_ms_max", "gflops", "gbs", "pct_bandwidth", "pct_peak", "flops",
                 "expert_bytes"}


@pytest.mark.slow
def test_layer_sweep_rows_and_rerun(tmp_path, capsys, tiny_layer_args):
    db_path = tmp_path / "r.db"
    args = tiny_layer_args + ["--experts", "fused,naive", "--db", str(db_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    # skeleton + I=64 + E=8 + k=1 (I=32, E=4, k=2 are the skeleton again) = 4 shapes x 2 impls x 2 M
    assert "16 cases in 8 units; 0 skipped" in out and "estimated time" in out and "16 ok" in out
    with ResultsDB(db_path) as db:
        rows = db.rows("layer")
        assert len(rows) == 16 and {r.status for r in rows} == {"ok"}
        assert len({case_key(r.case) for r in rows}) == 16          # the skeleton ran once, not once per axis
        for r in rows:
            assert set(r.case) == LAYER_CASE and LAYER_METRICS <= set(r.metrics), r
            assert r.case["format"] == "bf16" and r.case["threads"] == 1 and r.case["preset"] == "qwen3-30b-a3b"
            assert r.case["impl"] == ("naive" if r.case["backend"] == "naive" else "fused")
            m = r.metrics
            assert m["time_ms_min"] <= m["time_ms"] <= m["time_ms_max"] and m["gflops"] > 0 and m["gbs"] > 0
            assert m["flops"] == 2 * r.case["tokens"] * r.case["top_k"] * 3 * r.case["hidden"] * r.case["inter"]
            assert r.bandwidth_gbs > 0 and r.mm_gflops > 0
            assert m["pct_bandwidth"] == pytest.approx(100 * m["gbs"] / r.bandwidth_gbs)
    # again: everything is skipped, nothing is added
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "16 skipped" in out and "0 to run" in out
    with ResultsDB(db_path) as db:
        assert len(db.rows("layer")) == 16


@pytest.mark.slow
def test_new_axis_value_runs_only_the_new_cases(tmp_path, capsys, tiny_layer_args):
    db_path = tmp_path / "r.db"
    assert main(tiny_layer_args + ["--tokens", "1", "--db", str(db_path)]) == 0
    capsys.readouterr()
    assert main(tiny_layer_args + ["--tokens", "1,3", "--db", str(db_path)]) == 0
    assert "8 cases in 4 units; 4 skipped" in capsys.readouterr().out
    with ResultsDB(db_path) as db:
        assert sorted(r.case["tokens"] for r in db.rows("layer")) == [1] * 4 + [3] * 4


def test_too_large_is_oom_not_run(tmp_path, capsys, tiny_layer_args):
    db_path = tmp_path / "r.db"
    assert main(tiny_layer_args + ["--max-memory-gb", "0.01", "--db", str(db_path)]) == 0
    assert "do not fit" in capsys.readouterr().out
    with ResultsDB(db_path) as db:
        rows = db.rows("layer")
        assert len(rows) == 8 and {r.status for r in rows} == {"oom"}
        for r in rows:
            assert r.metrics["bytes_needed"] > 0.01e9 and r.metrics["bytes_available"] > 0
        assert db.done("layer", rows[0].case)   # an oom case is not tried again


def test_injected_memory_makes_only_the_large_shape_oom(tmp_path):
    """available() is injectable: with 1.2 GB 'available', the E=128 point of a tiny sweep does not fit."""
    skeleton = get_preset("qwen3-30b-a3b")
    shapes = [Shape(64, 32, 4, 2), Shape(1024, 1024, 128, 2, axis="experts")]   # the second: 805 MB of bf16
    units = layer_units(skeleton, shapes, ["bf16"], ["fused"], [1], RunOptions(threads=1))
    policy = MemoryPolicy(available=lambda: int(2.2e9))
    with ResultsDB(tmp_path / "r.db") as db:
        summary = run_sweep(units, db=db, policy=policy)
        assert summary.statuses == {"ok": 1, "oom": 1}
        oom = db.rows("layer", status="oom")[0]
        assert oom.case["experts"] == 128 and oom.metrics["bytes_available"] == int(2.2e9)
        assert oom.metrics["bytes_needed"] > 2 * 805e6   # the random weights and their packed copy


def test_paper_grid_memory_verdicts_on_a_24_gb_machine():
    """Mixtral's skeleton with 64 experts holds 22.5 GB of bf16 experts: never run on a machine with 24 GB."""
    g = get_grid("paper")
    skeleton = get_preset("mixtral-8x7b")
    shapes = arch_shapes(skeleton, dict(inter=g.inter, experts=g.experts, top_k=g.top_k, hidden=g.hidden))
    units = layer_units(skeleton, shapes, ["bf16"], ["fused"], g.tokens, RunOptions(threads=2))
    by_experts = {u.shape.experts: u.bytes_needed() for u in units if u.shape.axis in ("experts", "skeleton")}
    assert by_experts[64] > 22.5e9 and by_experts[8] < 8e9
    budget, _ = MemoryPolicy(available=lambda: 24 * 2**30).budget()
    assert by_experts[64] > budget > by_experts[16]


def test_a_case_that_raises_is_an_error_row_and_the_sweep_goes_on(tmp_path, capsys, tiny_layer_args):
    """int4 groups of 128 cannot split H=64: those cases fail; the bf16 ones run."""
    db_path = tmp_path / "r.db"
    assert main(tiny_layer_args + ["--dtype", "bf16,int4", "--inter", "32", "--num-experts", "4", "--top-k", "2",
                                   "--db", str(db_path)]) == 0
    out = capsys.readouterr().out
    assert "2 error" in out and "2 ok" in out and "2 case(s) failed" in out
    with ResultsDB(db_path) as db:
        errors = db.rows("layer", status="error")
        assert [r.case["format"] for r in errors] == ["int4", "int4"]
        assert "int4 group size 128 must be a multiple of 32" in errors[0].metrics["message"]
        assert not db.done("layer", errors[0].case)   # an error is tried again by the next run


def test_no_db_writes_nothing(tmp_path, capsys, tiny_layer_args, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(tiny_layer_args + ["--tokens", "1", "--num-experts", "4", "--inter", "32", "--top-k", "2",
                                   "--no-db"]) == 0
    assert "nothing written" in capsys.readouterr().out and not list(tmp_path.iterdir())


def test_dry_run_runs_nothing(tmp_path, capsys, tiny_layer_args):
    assert main(tiny_layer_args + ["--dry-run", "--db", str(tmp_path / "r.db")]) == 0
    assert "8 to run" in capsys.readouterr().out
    with ResultsDB(tmp_path / "r.db") as db:
        assert db.rows() == []


def test_units_and_pending():
    skeleton = get_preset("qwen3-30b-a3b")
    units = layer_units(skeleton, [Shape(64, 32, 4, 2)], ["bf16", "int8"], ["fused", "naive"], [1, 4],
                        RunOptions(threads=2))
    assert [(u.format_label, u.impl) for u in units] == [("bf16", "fused"), ("bf16", "naive"), ("int8", "fused"),
                                                         ("int8", "naive")]
    assert all(isinstance(u, LayerUnit) and u.backend != "none" for u in units)
    todo, skipped, total = pending_units(units + units, None)   # the same cases twice run once
    assert (len(todo), skipped, total) == (4, 0, 8)
    json.dumps([c for u in units for c in u.cases()])   # case dicts are JSON


@pytest.mark.parametrize("flags, message", [
    (["--tokens", "0"], "expected positive integers"),
    (["--grid", "nope"], "unknown grid 'nope'"),
    (["--dtype", "bf17"], "unknown dtype 'bf17'"),
    (["--experts", "fast"], "expected a comma list of fused, naive"),
    (["--skeleton-shape", "64,32,2,4"], "K <= E"),
    (["--no-db", "--db", "x.db"], "argument --db: not allowed with argument --no-db"),
])
def test_bad_flags_are_argparse_errors(flags, message, capsys, tiny_layer_args):
    with pytest.raises(SystemExit) as exit_:
        main(tiny_layer_args + flags)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--threads", "0"], "--threads must be positive"),
    (["--skeleton", "nope"], "unknown preset 'nope'"),
    (["--max-memory-gb", "-1"], "--max-memory-gb must be positive"),
])
def test_bad_values_are_clear_errors(flags, message, tiny_layer_args):
    with pytest.raises(SystemExit, match=f"cpumoe bench sweep layer: error: .*{message}"):
        main(tiny_layer_args + flags)
