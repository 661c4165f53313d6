# The layer benchmark: its FLOP and byte counts against hand-computed numbers, its pieces (format parsing, backend
# selection, memory plan, timing, speed-ups, targets), and tiny end-to-end runs through the CLI that must report
# every (format, backend) this CPU can run, and any format no backend could.
import json

import pytest
import torch

from cpumoe.bench.layer import (
    MEMORY_SHARE, Case, LayerCase, LayerResult, WeightFormat, add_speedups, case_nbytes, quantized_nbytes,
    weights_nbytes, compare_with_reference, experts_config, make_inputs,
    interquartile, parse_weight_format, plan_groups, reference_case, repetitions_for, select_backends, select_cases,
    target_for, turn_order,
)
from cpumoe.bench.machine import OtherCpuUse
from cpumoe.cli import main
from cpumoe.experts import all_backends
from cpumoe.presets import PRESETS, LayerPreset, get_preset
from cpumoe.quant import QuantFormat

TINY = LayerPreset("tiny", hidden=64, inter=32, experts=4, top_k=2, shared_experts=0, activation="silu",
                   scoring="softmax", renormalize=True)


def test_case_counts_qwen3_decode():
    case = LayerCase(hidden=2048, inter=768, experts=128, top_k=8, tokens=1, dtype=torch.bfloat16,
                     distinct_experts=8)
    assert case.flops() == 75_497_472          # 2 * 1 * 8 * 3 * 2048 * 768
    assert case.expert_bytes() == 9_437_184    # 3 * 2048 * 768 * 2 bytes
    assert case.bytes() == 75_497_472          # 8 experts


def test_case_counts_small_fp32():
    case = LayerCase(hidden=64, inter=32, experts=4, top_k=2, tokens=3, dtype=torch.float32)
    assert case.flops() == 73_728              # 2 * 3 * 2 * 3 * 64 * 32
    assert case.bytes() == 98_304              # no count given: min(E=4, M*k=6) experts * 3 * 64 * 32 * 4 bytes
    assert LayerCase(64, 32, 4, 2, 1, torch.float16, distinct_experts=1).bytes() == 12_288


def test_inputs_count_distinct_experts():
    inputs = make_inputs(TINY, 5, torch.bfloat16)
    assert inputs.hidden_states.shape == (5, 64) and inputs.router_logits.shape == (5, 4)
    assert 2 <= inputs.case.distinct_experts <= 4
    again = make_inputs(TINY, 5, torch.bfloat16)
    assert torch.equal(inputs.router_logits, again.router_logits), "inputs must be seeded"


def test_select_backends():
    config = experts_config(TINY, torch.float32)
    supported = [p.name for p in all_backends() if p.is_supported(config)[0]]
    assert select_backends(config) == supported and supported[-1] == "naive"
    assert select_backends(config, ["naive", "generic"]) == ["generic", "naive"]   # fastest first
    with pytest.raises(ValueError, match="unknown backend 'nope'; known: .*naive"):
        select_backends(config, ["nope"])


def test_repetitions_for():
    assert repetitions_for(1e-6, quick=False) == 30          # capped: each repetition also reads 1 GiB
    assert repetitions_for(0.5, quick=False) == 3            # at least 3
    assert repetitions_for(5.0, quick=False) == 2            # a very slow call
    assert 1 <= repetitions_for(1e-3, quick=True) <= 3


def test_other_cpu_use():
    with OtherCpuUse() as other:
        sum(range(100_000))
    assert other.fraction is None or 0 <= other.fraction <= 1


def _result(format, backend, tokens, ms, expert_bytes=100):
    return LayerResult(format=format, backend=backend, tokens=tokens, ms=ms, repetitions=3, distinct_experts=2,
                       expert_bytes=expert_bytes, gflops=1.0, gbs=1.0, bandwidth_gbs=1.0, bandwidth_pct=1.0,
                       mm_gflops=1.0, peak_pct=1.0)


def test_speedups():
    results = [_result("bfloat16", "fast", 4, 1.0), _result("bfloat16", "naive", 4, 5.0),
               _result("bfloat16", "fast", 8, 1.0), _result("int8_w8a8", "fast", 4, 2.0),
               _result("int8_w8a8", "naive", 4, 3.0), _result("int4_w4a16", "fast", 2048, 1.0)]
    add_speedups(results)
    assert [r.speedup_vs_naive for r in results] == [5.0, 1.0, None, 1.5, 1.0, None]   # naive of the same format
    assert [r.target_vs_bf16 for r in results] == [None, None, None, 1.8, 1.8, 1.2]


def test_targets():
    assert target_for("int8_w8a8", 1) == target_for("int8_w8a8", 8) == 1.8
    assert target_for("int4_w4a16", 8) == target_for("mxfp4_w4a16", 1) == 2.8 and target_for("fp8_w8a16", 1) == 1.6
    assert target_for("int8_w8a8", 2048) == 1.6 and target_for("int4_w4a16", 2048) == 1.2
    assert target_for("fp8_w8a16", 2048) == target_for("mxfp4_w4a16", 4096) == 0.9
    assert target_for("int8_w8a8", 128) is None and target_for("bfloat16", 1) is None


def test_compare_with_reference():
    bf16, int4 = Case(WeightFormat(torch.bfloat16), "fast"), Case(parse_weight_format("int4"), "fast")
    decode = {bf16: _result("bfloat16", "fast", 1, 3.0, expert_bytes=400),
              int4: _result("int4_w4a16", "fast", 1, 1.5, expert_bytes=125)}
    compare_with_reference(decode, bf16)
    assert decode[int4].speedup_vs_bf16 == 2.0 and decode[int4].bytes_bound_vs_bf16 == 3.2
    assert decode[bf16].speedup_vs_bf16 == 1.0
    prefill = {bf16: _result("bfloat16", "fast", 2048, 3.0), int4: _result("int4_w4a16", "fast", 2048, 2.0)}
    compare_with_reference(prefill, bf16)
    assert prefill[int4].speedup_vs_bf16 == 1.5 and prefill[int4].bytes_bound_vs_bf16 is None   # decode only
    alone = {int4: _result("int4_w4a16", "fast", 1, 1.0)}
    compare_with_reference(alone, None)
    assert alone[int4].speedup_vs_bf16 is None


def test_speedup_pairs_repetitions():
    """With each repetition's times, the speed-up is the median of the repetitions' ratios, not the ratio of the
    medians: the machine slowed down in repetition 2 for both, and that pair still says 3x."""
    bf16, int4 = Case(WeightFormat(torch.bfloat16), "fast"), Case(parse_weight_format("int4"), "fast")
    results = {bf16: _result("bfloat16", "fast", 1, 3.0), int4: _result("int4_w4a16", "fast", 1, 1.5)}
    results[bf16].times_ms = [3.0, 3.0, 6.0, 3.0]
    results[int4].times_ms = [1.5, 1.0, 2.0, 1.5, 1.2]   # one repetition more than the reference: unpaired
    compare_with_reference(results, bf16)
    assert results[int4].speedup_vs_bf16 == 2.5            # ratios 2, 3, 3, 2; the medians' ratio says 2
    assert results[int4].speedup_vs_bf16_range == (2.0, 3.0)
    assert results[bf16].speedup_vs_bf16 == 1.0 and results[bf16].speedup_vs_bf16_range == (1.0, 1.0)


def test_turn_order():
    """Each case comes first after the probe in turn."""
    assert [turn_order(["a", "b", "c"], rep) for rep in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert turn_order([], 3) == []


def test_interquartile():
    assert interquartile([5.0, 1.0, 3.0]) == (1.0, 5.0)          # fewer than four: the extremes
    assert interquartile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == (2.0, 6.0)


@pytest.mark.parametrize("name, expected", [
    ("bf16", WeightFormat(torch.bfloat16)), ("float32", WeightFormat(torch.float32)),
    ("int8", WeightFormat(torch.bfloat16, QuantFormat.INT8_W8A8, 0)),           # per channel
    ("int4_w4a16", WeightFormat(torch.bfloat16, QuantFormat.INT4_W4A16, 64)),
    ("fp8", WeightFormat(torch.bfloat16, QuantFormat.FP8_W8A16, 64)),
    ("mxfp4", WeightFormat(torch.bfloat16, QuantFormat.MXFP4_W4A16, 32)),     # always groups of 32
])
def test_parse_weight_format(name, expected):
    assert parse_weight_format(name, group_size=64) == expected


def test_parse_weight_format_unknown():
    with pytest.raises(ValueError, match="unknown dtype 'int3'; choose from bf16, .*int8_w8a8"):
        parse_weight_format("int3")


def test_select_cases_and_reference():
    formats = [parse_weight_format(n, 32) for n in ("int8", "bf16", "mxfp4")]
    cases, unrun = select_cases(TINY, formats)
    assert unrun == [] and [c.format.name for c in cases][-1] == "mxfp4_w4a16"
    for fmt in formats:   # every format: its supported backends, fastest first, ending with naive
        assert [c.backend for c in cases if c.format == fmt] == select_backends(experts_config(TINY, fmt))
    ref = reference_case(cases)
    assert ref.format.name == "bfloat16" and ref.backend == select_backends(experts_config(TINY, torch.bfloat16))[0]
    assert reference_case([c for c in cases if c.format.quant is not None or c.backend == "naive"]) is None
    with pytest.raises(ValueError, match="int4 group size 128 must be a multiple of 32 dividing H=64 and I=32"):
        select_cases(TINY, [parse_weight_format("int4", 128)])


def test_plan_groups():
    cases, _ = select_cases(TINY, [parse_weight_format(n, 32) for n in ("bf16", "int8", "int4")])
    ref = reference_case(cases)
    assert plan_groups(TINY, cases, ref, available=1 << 40) == [cases]
    fixed = weights_nbytes(TINY, torch.bfloat16) + quantized_nbytes(TINY, parse_weight_format("int8"))
    largest = max(sum(case_nbytes(TINY, c) for c in {*(c for c in cases if c.format == f), ref})
                  for f in {c.format for c in cases})   # the biggest one-format group, with the reference
    by_format = plan_groups(TINY, cases, ref, available=int((fixed + largest) / MEMORY_SHARE) + 1)
    assert [{c.format.name for c in g if c != ref} for g in by_format] == [{"bfloat16"}, {"int8_w8a8"}, {"int4_w4a16"}]
    assert all(ref in g for g in by_format)
    one_by_one = plan_groups(TINY, cases, ref, available=0)
    assert [g[0] for g in one_by_one] == cases and all(g == [c] or g == [c, ref] for c, g in zip(cases, one_by_one))


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_run_on_naive(name):
    preset = get_preset(name)
    assert preset.name == name and preset.top_k <= preset.experts
    ok, why = dict((p.name, p) for p in all_backends())["naive"].is_supported(experts_config(preset, torch.bfloat16))
    assert ok, why


def test_get_preset_unknown():
    with pytest.raises(ValueError, match="unknown preset 'nope'; known: qwen3-30b-a3b, qwen3-235b-a22b, olmoe-1b-7b"):
        get_preset("nope")


def test_tiny_bench_json(tmp_path, capsys):
    out = tmp_path / "layer.json"
    assert main(["bench", "layer", "--hidden", "64", "--inter", "32", "--experts", "4", "--topk", "2",
                 "--tokens", "1,3", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    expected = select_backends(experts_config(TINY, torch.bfloat16))
    results = report["results"]
    assert [(r["format"], r["backend"], r["tokens"]) for r in results] == [("bfloat16", p, m) for m in (1, 3)
                                                                       for p in expected]
    for r in results:
        assert r["ms"] > 0 and r["gflops"] > 0 and r["gbs"] > 0 and r["repetitions"] >= 1, r
        assert r["bandwidth_gbs"] > 0 and r["mm_gflops"] > 0, r
        assert r["speedup_vs_naive"] is not None and r["speedup_vs_naive"] > 0, r
        assert 1 <= r["distinct_experts"] <= min(4, 2 * r["tokens"]), r
        assert len(r["times_ms"]) == r["repetitions"] and r["ms_min"] <= r["ms"] <= r["ms_max"], r
        low, high = r["bandwidth_pct_range"]
        assert 0 < low <= r["bandwidth_pct"] <= high, r
        # the kernel's own clock: a native backend's share of each call, none for the naive loop
        if r["backend"] == "naive":
            assert r["kernel_bandwidth_pct"] is None, r
        else:
            assert r["kernel_bandwidth_pct"] >= r["bandwidth_pct"] > 0, r
    assert report["machine"]["bandwidth_gbs"] > 0 and report["machine"]["mm_gflops"] > 0
    [fmt] = report["layer"]["formats"]
    assert report["layer"]["hidden"] == 64 and fmt["format"] == "bfloat16" and fmt["backends"] == expected
    assert fmt["oracle_choice"] == expected[0]
    assert report["other_cpu_fraction"] is None or 0 <= report["other_cpu_fraction"] <= 1
    printed = capsys.readouterr().out
    assert all(p in printed for p in expected) and "GFLOP/s" in printed and "kernel" in printed


def test_bench_rejects_unsupported_backend(capsys):
    with pytest.raises(SystemExit, match="unknown backend 'nope'"):
        main(["bench", "layer", "--hidden", "64", "--inter", "32", "--experts", "4", "--topk", "2",
              "--tokens", "1", "--backends", "nope"])


QUANT_ARGS = ["bench", "layer", "--hidden", "64", "--inter", "32", "--experts", "4", "--topk", "2", "--quick",
              "--group-size", "32"]


def test_tiny_bench_formats(tmp_path, capsys):
    """Several formats side by side: a row per (format, backend, M) with its packed bytes, the ratio to the bf16 fused
    backend and, for the quantized formats, the target (and the decode bound from bytes)."""
    out = tmp_path / "layer.json"
    assert main([*QUANT_ARGS, "--tokens", "1,3", "--dtype", "bf16,int8,int4_w4a16,fp8,mxfp4",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    names = ["bfloat16", "int8_w8a8", "int4_w4a16", "fp8_w8a16", "mxfp4_w4a16"]
    formats = report["layer"]["formats"]
    assert [f["format"] for f in formats] == names
    ref = report["layer"]["reference"]
    assert ref["format"] == "bfloat16" and ref["backend"] != "naive"
    rows = {(r["format"], r["backend"], r["tokens"]): r for r in report["results"]}
    for f in formats:
        config = experts_config(TINY, parse_weight_format(f["format"], 32))
        assert f["backends"] == select_backends(config) and "naive" in f["backends"], f
        assert f["oracle_choice"] == f["backends"][0]
        for backend in f["backends"]:
            for m in (1, 3):
                r = rows.pop((f["format"], backend, m))
                assert r["ms"] > 0 and r["gbs"] > 0 and r["expert_bytes"] > 0 and r["repetitions"] >= 1, r
                assert r["speedup_vs_bf16"] > 0 and r["bytes_bound_vs_bf16"] > 0, r   # M <= 8: decode
                low, high = r["speedup_vs_bf16_range"]
                assert 0 < low <= r["speedup_vs_bf16"] <= high, r
                assert r["speedup_vs_naive"] > 0, r
                quantized = f["format"] != "bfloat16"
                assert (r["target_vs_bf16"] is not None) == quantized, r
                if quantized and backend != "naive":   # packed blocks: fewer bytes than bf16
                    assert r["expert_bytes"] < 3 * 64 * 32 * 2 and r["bytes_bound_vs_bf16"] > 1, r
    assert not rows, f"unexpected rows {list(rows)}"
    assert report["layer"]["unrun"] == []
    tokens = [r["tokens"] for r in report["results"]]
    assert tokens == sorted(tokens), "rows are grouped by M"
    printed = capsys.readouterr().out
    assert all(n in printed for n in ("int8_w8a8", "int4_w4a16", "fp8_w8a16", "mxfp4_w4a16", "vs bf16 (target)"))


def _backend_without(fmt: str) -> str | None:
    """A backend that runs the tiny layer in bf16 but not in `fmt` on this machine (None: every such backend runs
    it)."""
    bf16, quant = experts_config(TINY, torch.bfloat16), experts_config(TINY, parse_weight_format(fmt, 32))
    return next((p.name for p in all_backends() if p.is_supported(bf16)[0] and not p.is_supported(quant)[0]), None)


def test_format_no_backend_runs_is_reported(tmp_path, capsys):
    fmt = next((f for f in ("int8", "int4", "fp8", "mxfp4") if _backend_without(f)), None)
    if fmt is None:
        pytest.skip("every backend that runs bf16 here runs every quantized format")
    backend = _backend_without(fmt)
    out = tmp_path / "layer.json"
    assert main([*QUANT_ARGS, "--tokens", "1", "--dtype", f"bf16,{fmt}", "--backends", backend,
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    name = parse_weight_format(fmt).name
    [unrun] = report["layer"]["unrun"]
    assert unrun["format"] == name and list(unrun["reasons"]) == [backend] and unrun["reasons"][backend]
    assert {(r["format"], r["backend"]) for r in report["results"]} == {("bfloat16", backend)}
    assert f"{name}: no backend could run it" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=f"no backend can run any of these formats:\n  {name}: {backend}: "):
        main([*QUANT_ARGS, "--tokens", "1", "--dtype", fmt, "--backends", backend])


def test_quantized_without_bf16_has_no_ratio(tmp_path, capsys):
    out = tmp_path / "layer.json"
    assert main([*QUANT_ARGS, "--tokens", "1", "--dtype", "int8", "--backends", "naive", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    [row] = report["results"]
    assert row["format"] == "int8_w8a8" and row["speedup_vs_bf16"] is None and row["target_vs_bf16"] == 1.8
    assert report["layer"]["reference"] is None
    assert "add bf16 to --dtype" in capsys.readouterr().out
