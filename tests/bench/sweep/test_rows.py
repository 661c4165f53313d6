"""record_layer_report / record_model_report: the `bench layer` and `bench model` reports as results-DB rows, with
the case dicts the sweeps write (so a sweep skips what those commands recorded)."""
import pytest
import torch

from cpumoe.bench.layer import parse_weight_format, run_layer_bench
from cpumoe.bench.model import ModelCase, run_formats_bench, run_model_bench
from cpumoe.bench.results import ResultsDB
from cpumoe.bench.sweep.grid import Shape
from cpumoe.bench.sweep.plan import RunOptions, layer_units, model_units
from cpumoe.bench.sweep.rows import format_label, record_layer_report, record_model_report
from cpumoe.bench.sweep.work import machine_info
from cpumoe.presets import get_preset
from cpumoe.synthetic.checkpoint import make_checkpoint, tiny_overrides

MODEL_CASE = {"model", "format", "batch", "input_len", "output_len", "threads", "impl", "layers", "hidden", "inter",
              "experts", "top_k"}
MODEL_METRICS = {"ttft_ms", "itl_ms", "e2e_s", "throughput_tok_s", "decode_tok_s", "prefill_tok_s",
                 "decode_pct_bandwidth", "prefill_pct_peak", "peak_rss_gb"}


def test_format_label():
    assert [format_label(n) for n in ("bfloat16", "float32", "int8_w8a8", "mxfp4_w4a16", "bf16")] == [
        "bf16", "fp32", "int8", "mxfp4", "bf16"]
    assert format_label("int4_w4a16", 128) == "int4" and format_label("int4_w4a16", 32) == "int4-g32"


def test_record_layer_report(tmp_path):
    torch.set_num_threads(1)
    preset = Shape(64, 32, 4, 2).preset(get_preset("qwen3-30b-a3b"))
    formats = [parse_weight_format("bf16"), parse_weight_format("int4", 32)]
    report = run_layer_bench(preset, formats, [1, 3], quick=True, machine=machine_info(1, torch.bfloat16))
    with ResultsDB(tmp_path / "r.db") as db:
        ids = record_layer_report(db, report)
        rows = db.rows("layer")
        assert len(ids) == len(report["results"]) == len(rows)
        for r, result in zip(rows, report["results"]):
            assert r.case["tokens"] == result["tokens"] and r.case["backend"] == result["backend"]
            assert r.case["format"] in ("bf16", "int4-g32") and r.case["threads"] == 1
            assert r.metrics["time_ms"] == result["ms"] and r.metrics["pct_peak"] == result["peak_pct"]
            assert r.bandwidth_gbs == result["bandwidth_gbs"]
        # the sweep's case for the same point is the same case: it would be skipped
        unit = layer_units(get_preset("qwen3-30b-a3b"), [Shape(64, 32, 4, 2)], ["bf16"], ["naive"], [1, 3],
                           RunOptions(threads=1))[0]
        assert all(db.done("layer", c) for c in unit.cases())


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    from cpumoe.loader.quantized.convert import quantize_checkpoint
    root = tmp_path_factory.mktemp("ckpt")
    bf16 = make_checkpoint("qwen3-30b-a3b", root / "tiny-bf16", layers=1, vocab=300, dtype=torch.bfloat16,
                           overrides=tiny_overrides("qwen3-30b-a3b"))
    int8 = quantize_checkpoint(bf16, root / "tiny-int8", "int8").path
    return bf16, int8


@pytest.mark.slow
def test_record_model_report(tmp_path, tiny_checkpoints):
    bf16, int8 = tiny_checkpoints
    torch.set_num_threads(1)
    report = run_model_bench(bf16, [ModelCase(1, 8, 3), ModelCase(2, 8, 1)], compare_naive=True, quick=True)
    with ResultsDB(tmp_path / "r.db") as db:
        record_model_report(db, report)
        rows = db.rows("model")
        assert [(r.case["batch"], r.case["impl"]) for r in rows] == [(1, "fused"), (1, "naive"), (2, "fused"),
                                                                     (2, "naive")]
        for r in rows:
            assert set(r.case) == MODEL_CASE and MODEL_METRICS <= set(r.metrics)
            assert r.case["model"] == "tiny-bf16" and r.case["format"] == "bf16" and r.case["layers"] is None
            assert (r.case["hidden"], r.case["inter"], r.case["experts"], r.case["top_k"]) == (64, 32, 4, 2)
            m = r.metrics
            assert m["prefill_tok_s"] > 0 and m["ttft_ms"] > 0 and m["peak_rss_gb"] > 0
            assert m["throughput_tok_s"] == pytest.approx(r.case["batch"] * (8 + r.case["output_len"]) / m["e2e_s"])
        assert rows[2].metrics["decode_tok_s"] is None   # one output token: no decode step was measured
        # a runtime sweep of the same checkpoint and cases would skip them all
        unit = model_units([str(bf16)], None, None, ["fused", "naive"], ((1, 8, 3), (2, 8, 1)),
                           RunOptions(threads=1))
        assert all(db.done("model", c) for u in unit for c in u.cases())

        formats = run_formats_bench([bf16, int8], [ModelCase(1, 8, 2)], quick=True)
        record_model_report(db, formats, model_name=["tiny", "tiny-int8"])
        new = db.rows("model")[4:]
        assert [(r.case["model"], r.case["format"]) for r in new] == [("tiny", "bf16"), ("tiny-int8", "int8")]
        with pytest.raises(ValueError, match="1 model names for 2 checkpoints"):
            record_model_report(db, formats, model_name=["one"])
