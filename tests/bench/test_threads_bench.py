"""`cpumoe bench threads`: the rows it reads back from its children's reports, the table, the default counts, and a
real run of the experts op and a small checkpoint's decode at 1 and 2 threads."""
import json
from dataclasses import asdict

import pytest
import torch
from rich.console import Console

from cpumoe.bench.threads import render_thread_scaling, row_from_reports, run_thread_scaling
from cpumoe.bench.threads.cli import default_threads
from cpumoe.presets import get_preset
from cpumoe.synthetic.checkpoint import make_checkpoint, tiny_overrides


def layer_report(probe, ms_by_m):
    return {"machine": {"bandwidth_gbs": probe},
            "results": [{"tokens": m, "ms": ms, "bandwidth_pct": 80.0} for m, ms in ms_by_m.items()]}


def model_report(tok_s_by_batch, probe):
    return {"results": [{"batch": b, "decode_tok_s": v, "decode_bandwidth_pct": 90.0, "bandwidth_gbs": probe}
                        for b, v in tok_s_by_batch.items()]}


def test_rows_come_back_through_json_and_the_table_gives_each_count_against_the_first():
    rows = [row_from_reports(1, layer_report(10.0, {1: 4.0, 16: 40.0}), model_report({1: 20.0, 16: 50.0}, 11.0)),
            row_from_reports(4, layer_report(30.0, {1: 1.6, 16: 12.5}), model_report({1: 50.0, 16: 150.0}, 29.0))]
    assert rows[1].experts_ms == {1: 1.6, 16: 12.5} and rows[1].model_probe_gbs == 29.0
    report = json.loads(json.dumps(dict(backend="x86-test", preset="qwen3-30b-a3b", model="m", input_len=128,
                                        output_len=32, rows=[asdict(r) for r in rows])))
    console = Console(record=True, width=200)
    render_thread_scaling(report, console)
    text = console.export_text()
    assert "30.0 (3.00x)" in text          # the probe's own scaling
    assert "1.60 (2.50x, 80%)" in text     # experts at M = 1: 4.0 ms / 1.6 ms
    assert "150.0 (3.00x, 90%)" in text    # batch-16 decode: 150 / 50 tok/s


def test_a_count_without_a_model_has_no_decode_columns():
    row = row_from_reports(2, layer_report(20.0, {1: 2.0}), None)
    assert row.decode_tok_s == {} and row.experts_ms == {1: 2.0}


@pytest.mark.parametrize("cores,counts", [(1, [1]), (2, [1, 2]), (12, [1, 2, 4, 8, 12]), (16, [1, 2, 4, 8, 16])])
def test_default_counts_double_up_to_the_cores(monkeypatch, cores, counts):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    assert default_threads() == counts


@pytest.mark.slow
def test_a_real_run_at_one_and_two_threads(tmp_path):
    checkpoint = make_checkpoint("qwen3-30b-a3b", tmp_path / "ckpt", layers=2, vocab=400, dtype=torch.bfloat16,
                                 overrides=tiny_overrides("qwen3-30b-a3b"))
    report = run_thread_scaling(str(checkpoint), get_preset("qwen3-30b-a3b"), [1, 2], tokens=[1], batches=[1, 2],
                                input_len=16, output_len=4, quick=True)
    assert [r["threads"] for r in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert row["layer_probe_gbs"] > 0 and row["experts_ms"][1] > 0
        assert set(row["decode_tok_s"]) == {1, 2} and min(row["decode_tok_s"].values()) > 0
    assert any(" --threads 2 " in c for c in report["commands"])
