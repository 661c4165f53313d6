# The layer benchmark: its FLOP and byte counts against hand-computed numbers, its pieces (path selection, timing,
# speed-ups), and one tiny end-to-end run through the CLI that must report every path this CPU can run.
import json

import pytest
import torch

from cpumoe.bench.layer import (
    LayerCase, LayerResult, add_speedups, experts_config, make_inputs, repetitions_for, select_paths,
)
from cpumoe.bench.machine import OtherCpuUse
from cpumoe.cli import main
from cpumoe.experts import all_paths
from cpumoe.presets import PRESETS, LayerPreset, get_preset

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


def test_select_paths():
    config = experts_config(TINY, torch.float32)
    supported = [p.name for p in all_paths() if p.is_supported(config)[0]]
    assert select_paths(config) == supported and supported[-1] == "naive"
    assert select_paths(config, ["naive", "generic"]) == ["generic", "naive"]   # fastest first
    with pytest.raises(ValueError, match="unknown path 'nope'; known: .*naive"):
        select_paths(config, ["nope"])


def test_repetitions_for():
    assert repetitions_for(1e-6, quick=False) == 30          # capped: each repetition also reads 1 GiB
    assert repetitions_for(0.5, quick=False) == 3            # at least 3
    assert repetitions_for(5.0, quick=False) == 2            # a very slow call
    assert 1 <= repetitions_for(1e-3, quick=True) <= 3


def test_other_cpu_use():
    with OtherCpuUse() as other:
        sum(range(100_000))
    assert other.fraction is None or 0 <= other.fraction <= 1


def test_speedups():
    common = dict(repetitions=3, distinct_experts=2, gflops=1.0, gbs=1.0, bandwidth_gbs=1.0, bandwidth_pct=1.0,
                  mm_gflops=1.0, peak_pct=1.0)
    results = [LayerResult("fast", 4, 1.0, **common), LayerResult("naive", 4, 5.0, **common),
               LayerResult("fast", 8, 1.0, **common)]
    add_speedups(results)
    assert [r.speedup_vs_naive for r in results] == [5.0, 1.0, None]


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_run_on_naive(name):
    preset = get_preset(name)
    assert preset.name == name and preset.top_k <= preset.experts
    ok, why = dict((p.name, p) for p in all_paths())["naive"].is_supported(experts_config(preset, torch.bfloat16))
    assert ok, why


def test_get_preset_unknown():
    with pytest.raises(ValueError, match="unknown preset 'nope'; known: qwen3-30b-a3b, olmoe-1b-7b"):
        get_preset("nope")


def test_tiny_bench_json(tmp_path, capsys):
    out = tmp_path / "layer.json"
    assert main(["bench", "layer", "--hidden", "64", "--inter", "32", "--experts", "4", "--topk", "2",
                 "--tokens", "1,3", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    expected = select_paths(experts_config(TINY, torch.bfloat16))
    results = report["results"]
    assert [(r["path"], r["tokens"]) for r in results] == [(p, m) for m in (1, 3) for p in expected]
    for r in results:
        assert r["ms"] > 0 and r["gflops"] > 0 and r["gbs"] > 0 and r["repetitions"] >= 1, r
        assert r["bandwidth_gbs"] > 0 and r["mm_gflops"] > 0, r
        assert r["speedup_vs_naive"] is not None and r["speedup_vs_naive"] > 0, r
        assert 1 <= r["distinct_experts"] <= min(4, 2 * r["tokens"]), r
    assert report["machine"]["bandwidth_gbs"] > 0 and report["machine"]["mm_gflops"] > 0
    assert report["layer"]["hidden"] == 64 and report["layer"]["dtype"] == "bfloat16"
    assert report["layer"]["oracle_choice"] == expected[0]
    assert report["other_cpu_fraction"] is None or 0 <= report["other_cpu_fraction"] <= 1
    printed = capsys.readouterr().out
    assert all(p in printed for p in expected) and "GFLOP/s" in printed


def test_bench_rejects_unsupported_path(capsys):
    with pytest.raises(SystemExit, match="unknown path 'nope'"):
        main(["bench", "layer", "--hidden", "64", "--inter", "32", "--experts", "4", "--topk", "2",
              "--tokens", "1", "--paths", "nope"])
