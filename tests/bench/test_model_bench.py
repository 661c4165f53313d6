"""The model benchmark end to end on a tiny synthetic checkpoint, fused beside naive."""
import json
from dataclasses import asdict

import pytest
import torch

from cpumoe.bench.model import (ModelCase, ModelResult, WeightBytes, batch_scaling, engine_config,
                               format_comparison)
from cpumoe.cli import main
from cpumoe.models import ARCHITECTURES, load_model, model_presets
from cpumoe.models.blocks import MoEBlock
from cpumoe.synthetic.checkpoint import make_checkpoint, tiny_overrides


def test_engine_config_fits_the_largest_case():
    config = engine_config([ModelCase(1, 128, 16), ModelCase(4, 30, 3)])
    assert config.num_blocks >= max(1 * 9, 4 * 3) and config.max_num_seqs == 4 and config.max_model_len == 144


def test_bench_model_json(tmp_path, capsys):
    path = make_checkpoint("qwen3-30b-a3b", tmp_path / "ckpt", layers=2, vocab=400, dtype=torch.float32,
                           overrides=tiny_overrides("qwen3-30b-a3b"))
    out = tmp_path / "model.json"
    assert main(["bench", "model", str(path), "--batch", "1,3", "--input-len", "9", "--output-len", "4",
                 "--compare", "naive", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert [(r["batch"], r["backend"] == "naive") for r in results] == [(1, False), (1, True), (3, False), (3, True)]
    for r in results:
        assert r["ttft_ms"] > 0 and r["itl_ms"] > 0 and r["throughput_tok_s"] > 0, r
        assert r["decode_gbs"] > 0 and r["prefill_gflops"] > 0 and r["peak_rss_gb"] > 0, r
        # % bw is of the mean of the read probes right before and right after the case
        assert r["bandwidth_before_gbs"] > 0 and r["bandwidth_after_gbs"] > 0, r
        assert r["bandwidth_gbs"] == pytest.approx((r["bandwidth_before_gbs"] + r["bandwidth_after_gbs"]) / 2)
        assert r["decode_bandwidth_pct"] == pytest.approx(100 * r["decode_gbs"] / r["bandwidth_gbs"])
    assert report["weights"]["moe_layers"] == 2 and report["weights"]["experts"] == 4
    w = report["weights"]
    assert w["head_elems"] == 400 * load_model(path).config.hidden_size  # the untied lm_head [V, H]
    files = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert report["checkpoint_gb"] == pytest.approx(files / 1e9)
    # batch 3 against batch 1, per backend; 4 experts top-2: 3 tokens read ~3.6 of them, 1 token 2
    scaling = report["batch_scaling"]
    assert [(s["batch"], s["backend"] == "naive") for s in scaling] == [(3, False), (3, True)]
    for s in scaling:
        assert s["decode_speedup"] > 0 and 1 < s["bandwidth_bound_speedup"] < 3, s
        # counting the GEMMs' FLOPs too can only lower the bound (float weights: the mm probe's rate applies)
        assert 0 < s["bytes_and_gemms_bound_speedup"] <= s["bandwidth_bound_speedup"] * (1 + 1e-9), s
    # counted routing: one token picks exactly top_k = 2 experts per layer; three pick 2 to 4 of the 4
    assert [r["decode_experts_per_layer"] for r in results if r["batch"] == 1] == [2.0, 2.0]
    assert all(2 <= r["decode_experts_per_layer"] <= 4 for r in results if r["batch"] == 3)
    # Every dense weight counted once, packed or not: the naive model keeps them all as nn.Linear parameters.
    naive = load_model(path, backend="naive")
    dense = sum(p.numel() for p in naive.parameters()) - naive.model.embed_tokens.weight.numel()
    assert report["weights"]["dense_elems"] == dense
    out = capsys.readouterr().out
    assert "TTFT ms" in out and "x checkpoint + KV cache" in out and "decode batch scaling" in out


def test_bench_model_missing_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="cpumoe bench model: error"):
        main(["bench", "model", str(tmp_path / "nope"), "--batch", "1", "--input-len", "4", "--output-len", "2"])


def test_bench_model_quantized_checkpoints_side_by_side(tmp_path, capsys):
    """Checkpoints quantized by `cpumoe quantize`, beside their bf16 source in one run: each reports its format and
    the quantized bytes its steps stream, and the comparison rows give speed-ups against the first with the bound."""
    from cpumoe.loader.quantized.convert import quantize_checkpoint
    src = make_checkpoint("qwen3-30b-a3b", tmp_path / "bf16", layers=2, vocab=400, dtype=torch.bfloat16,
                          overrides=tiny_overrides("qwen3-30b-a3b"))
    int4 = quantize_checkpoint(src, tmp_path / "int4", "int4", group_size=32).path
    fp8 = quantize_checkpoint(src, tmp_path / "fp8", "fp8").path
    out = tmp_path / "formats.json"
    assert main(["bench", "model", str(src), str(int4), str(fp8), "--batch", "1,2", "--input-len", "9",
                 "--output-len", "3", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [m["weights_format"] for m in report["models"]] == ["bf16", "int4_w4a16", "fp8_w8a16"]
    # each load's packed weights (memory that asked for huge pages) and the part of them the kernel put on huge
    # pages (this machine's THP mode decides how much)
    assert all(0 < m["packed_gb"] and 0 <= m["packed_huge_pages_gb"] <= m["packed_gb"] for m in report["models"])
    bf16, q4 = report["models"][0]["weights"], report["models"][1]["weights"]
    assert bf16["expert_elems"] == q4["expert_elems"] and bf16["dense_elems"] == q4["dense_elems"]
    # 4-bit codes plus a float32 scale per 32 weights (symmetric: no zero points): 0.5 + 4/32 = 0.625 bytes a
    # weight, against 2
    assert q4["expert"] == pytest.approx(bf16["expert"] * 0.625 / 2, rel=0.01) and q4["dense"] < bf16["dense"]
    assert [(r["batch"], r["weights_format"]) for r in report["results"]] == [
        (1, "bf16"), (1, "int4_w4a16"), (1, "fp8_w8a16"), (2, "bf16"), (2, "int4_w4a16"), (2, "fp8_w8a16")]
    rows = report["comparison"]
    assert [(c["batch"], c["weights_format"]) for c in rows] == [(1, "int4_w4a16"), (1, "fp8_w8a16"),
                                                                 (2, "int4_w4a16"), (2, "fp8_w8a16")]
    for c in rows:
        assert c["decode_speedup"] > 0 and c["prefill_speedup"] > 0 and c["decode_bound"] > 1, c
        # --quick: one prompt of each case prefilled by each checkpoint in turn; its output length - 1 decode steps
        assert c["prefill_pairs"] == 1 and c["decode_pairs"] == 2, c
    assert all(r["prefill_interleaved_ms"] > 0 and r["decode_step_interleaved_ms"] > 0 for r in report["results"])
    printed = capsys.readouterr().out
    assert "against bf16" in printed and "huge pages" in printed
    with pytest.raises(SystemExit, match="--compare naive takes one checkpoint"):
        main(["bench", "model", str(src), str(int4), "--compare", "naive", "--batch", "1", "--input-len", "4",
              "--output-len", "2"])


def test_format_speedups_pair_each_repetition():
    """A speed-up is the median of the ratios within each repetition, with their range: here the machine ran at
    half speed in the second of three repetitions, and the checkpoint is 2x faster in every one. The ratio of the
    two medians would read 1x-4x depending on which repetitions the medians fall in."""
    def result(decode, prefill):
        return ModelResult(backend="b", batch=1, input_len=8, output_len=4, ttft_ms=1.0, itl_ms=1.0, e2e_s=1.0,
                           throughput_tok_s=1.0, decode_tok_s=decode, decode_gbs=1.0, decode_experts_per_layer=8.0,
                           decode_bandwidth_pct=1.0, bandwidth_gbs=1.0, prefill_gflops=prefill, prefill_mm_pct=1.0,
                           mm_gflops=1.0, peak_rss_gb=1.0)
    case = ModelCase(1, 8, 4)
    runs = {(0, case): [result(10, 100), result(5, 50), result(10, 100)],
            (1, case): [result(20, 150), result(10, 75), result(21, 160)]}
    results = [dict(asdict(runs[(i, case)][1]), model=i, weights_format=f) for i, f in enumerate(["bf16", "int8"])]
    weights = WeightBytes(dense_elems=1, expert_elems=1, dense=10, expert=10, moe_layers=1, experts=16, top_k=2,
                          kv_per_token=0)
    [row] = format_comparison(results, runs, [weights, weights])
    assert row["decode_speedup"] == pytest.approx(2.0) and row["decode_speedup_range"] == pytest.approx((2.0, 2.1))
    assert row["prefill_speedup"] == pytest.approx(1.5) and row["prefill_speedup_range"] == pytest.approx((1.5, 1.6))
    # With prefills and decode steps that both ran in turn, the ratios pair those, not the cases' own runs: here
    # the machine ran at half speed for the second prompt, and the checkpoint prefills 1.25x faster each time; its
    # decode steps are 1.5x faster in the first repetition and 2x in the second.
    prefills = {(0, case): [[1.0, 2.0], [1.0, 1.1]], (1, case): [[0.8, 1.6], [0.8, 0.88]]}
    decodes = {(0, case): [[0.03, 0.03, 0.06], [0.02, 0.02]], (1, case): [[0.02, 0.02, 0.04], [0.01, 0.01]]}
    [row] = format_comparison(results, runs, [weights, weights], prefills, decodes)
    assert row["prefill_speedup"] == pytest.approx(1.25) and row["prefill_speedup_range"] == pytest.approx((1.25, 1.25))
    assert row["prefill_pairs"] == 4
    assert row["decode_speedup"] == pytest.approx(1.5) and row["decode_speedup_range"] == pytest.approx((1.5, 2.0))
    assert row["decode_pairs"] == 5


def test_bench_model_batch_invariant_side_by_side(tmp_path, capsys):
    """--batch-invariant runs the checkpoint twice side by side, the second engine batch-invariant: the mode's cost
    in the same run, with a bound of 1x (the same bytes per step)."""
    src = make_checkpoint("qwen3-30b-a3b", tmp_path / "bf16", layers=2, vocab=400, dtype=torch.bfloat16,
                          overrides=tiny_overrides("qwen3-30b-a3b"))
    out = tmp_path / "invariant.json"
    assert main(["bench", "model", str(src), "--batch-invariant", "--batch", "1,2", "--input-len", "9",
                 "--output-len", "3", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [m["weights_format"] for m in report["models"]] == ["bf16", "bf16 invariant"]
    rows = report["comparison"]
    assert [(c["batch"], c["weights_format"]) for c in rows] == [(1, "bf16 invariant"), (2, "bf16 invariant")]
    assert all(c["decode_bound"] == pytest.approx(1.0) and c["decode_speedup"] > 0 for c in rows)
    assert "against bf16" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="do not go together"):
        main(["bench", "model", str(src), "--batch-invariant", "--compare", "naive", "--batch", "1"])


@pytest.mark.parametrize("preset", [arch.presets[0].name for arch in ARCHITECTURES.values()])
def test_bench_model_runs_every_architecture(preset, tmp_path):
    """make-model's tiny checkpoint of each architecture through the model benchmark: its MoE layers counted."""
    arch, _ = model_presets()[preset]
    path = make_checkpoint(preset, tmp_path / "ckpt", layers=2, vocab=400, overrides=tiny_overrides(preset))
    out = tmp_path / "model.json"
    assert main(["bench", "model", str(path), "--batch", "1", "--input-len", "9", "--output-len", "3", "--quick",
                 "--no-db", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    moe_layers = sum(isinstance(m, MoEBlock) for m in load_model(path).modules())
    assert report["weights"]["moe_layers"] == moe_layers >= 1, arch.model_type
    assert report["results"][0]["itl_ms"] > 0


def test_make_model_refuses_a_model_without_moe_layers(tmp_path):
    """DeepSeek-V3's tiny config has one dense layer first: a one-layer checkpoint of it would have no experts."""
    with pytest.raises(ValueError, match="deepseek-v3 with 1 layer.* has no MoE layer"):
        make_checkpoint("deepseek-v3", tmp_path / "ckpt", layers=1, vocab=400, overrides=tiny_overrides("deepseek-v3"))


def _weights(**kw) -> WeightBytes:
    base = dict(dense_elems=100_000_000, expert_elems=5_000_000, dense=200_000_000, expert=10_000_000, moe_layers=4,
                experts=128, top_k=8, kv_per_token=1000)
    return WeightBytes(**{**base, **kw})


def test_decode_step_floor_is_bytes_or_flops_whichever_is_longer_per_gemm():
    w = _weights()
    # bytes only: the step's bytes at the bandwidth
    assert w.decode_step_floor_s(4, 100, 20.0, 10.0, None) == pytest.approx(w.decode_step_bytes(4, 100, 20.0) / 10e9)
    # 1 token at 100 GFLOP/s: 0.2 GFLOP of dense GEMMs take 2 ms, under their 20 ms of bytes; the same for experts
    assert w.decode_step_floor_s(1, 0, 8.0, 10.0, 100.0) == pytest.approx(w.decode_step_floor_s(1, 0, 8.0, 10.0, None))
    # 16 tokens: the dense GEMMs' 3.2 GFLOP take 32 ms, over their 20 ms of bytes; the experts' 16 x 4 x 8 x 10 MFLOP
    # = 5.12 GFLOP take 51.2 ms, under their 80 x 4 x 10 MB = 320 ms of bytes
    assert w.decode_step_floor_s(16, 0, 80.0, 10.0, 100.0) == pytest.approx(0.032 + 0.32)
    # at 10 GFLOP/s the experts are compute-bound too: 512 ms
    assert w.decode_step_floor_s(16, 0, 80.0, 10.0, 10.0) == pytest.approx(0.32 + 0.512)


def test_step_floor_counts_the_lm_head_for_sampled_tokens_only():
    """A prompt chunk's tokens but its last get no logits: a step of 2048 tokens, 4 of them sampled, every expert
    chosen."""
    w = _weights(head_elems=40_000_000)
    dense_flops = 2.0 * (60_000_000 * 2048 + 40_000_000 * 4)          # 245.8 GFLOP: 2.458 s at 100 GFLOP/s
    expert_flops = 2.0 * 2048 * 4 * 8 * 5_000_000                      # 655.4 GFLOP: 6.554 s
    kv = 2048 * 1000 / 10e9
    assert w.step_floor_s(2048, 4, 2048, 128.0, 10.0, 100.0) == pytest.approx((dense_flops + expert_flops) / 100e9 + kv)
    # bytes only: what the same step reads
    assert w.step_floor_s(2048, 4, 2048, 128.0, 10.0, None) == pytest.approx((200e6 + 4 * 128 * 10e6) / 10e9 + kv)
    # a decode step is a step whose every token is sampled
    assert w.decode_step_floor_s(16, 100, 80.0, 10.0, 100.0) == pytest.approx(w.step_floor_s(16, 16, 1600, 80.0, 10.0,
                                                                                             100.0))
    assert w.prefill_flops(4, 512) == pytest.approx(w.step_flops(2048, 4))


def test_batch_scaling_gives_the_bound_of_bytes_and_gemms_beside_the_bytes_one():
    w = _weights()
    common = dict(backend="x", input_len=100, output_len=20, ttft_ms=1.0, itl_ms=1.0, e2e_s=1.0, throughput_tok_s=1.0,
                  decode_gbs=1.0, decode_bandwidth_pct=1.0, prefill_gflops=1.0, prefill_mm_pct=1.0, peak_rss_gb=1.0,
                  bandwidth_gbs=10.0, mm_gflops=100.0)
    one = ModelResult(batch=1, decode_tok_s=10.0, decode_experts_per_layer=8.0, **common)
    sixteen = ModelResult(batch=16, decode_tok_s=20.0, decode_experts_per_layer=80.0, **common)
    (row,) = batch_scaling([one, sixteen], w)
    assert row["bytes_and_gemms_bound_speedup"] < row["bandwidth_bound_speedup"]   # compute-bound at 16 rows here
    context = 110
    expected = 16 * w.decode_step_floor_s(1, context, 8.0, 10.0, 100.0) / w.decode_step_floor_s(16, context, 80.0, 10.0,
                                                                                                 100.0)
    assert row["bytes_and_gemms_bound_speedup"] == pytest.approx(expected)
    assert row["pct_of_bytes_and_gemms_bound"] == pytest.approx(100 * 2.0 / expected)
    (bytes_only,) = batch_scaling([one, sixteen], w, count_compute=False)   # quantized weights: bytes only
    assert bytes_only["bytes_and_gemms_bound_speedup"] == pytest.approx(bytes_only["bandwidth_bound_speedup"])
