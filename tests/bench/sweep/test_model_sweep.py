"""`cpumoe bench sweep arch-model` and `sweep model` on tiny synthetic checkpoints: `model` rows, the synthetic
checkpoints deleted after use, oom before building, resume."""
import pytest
import torch

from cpumoe.bench.results import ResultsDB
from cpumoe.cli import main
from cpumoe.synthetic.checkpoint import make_checkpoint, tiny_overrides

ARCH = ["bench", "sweep", "arch-model", "--tiny", "--skeleton", "qwen3-30b-a3b", "--skeleton-shape", "64,32,4,2",
        "--hidden", "64", "--inter", "32", "--num-experts", "4", "--top-k", "1,2", "--layers", "1", "--vocab", "300",
        "--batch", "1,2", "--input-len", "8", "--output-len", "3", "--threads", "1"]


@pytest.mark.slow
def test_arch_model_sweep(tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    db_path = tmp_path / "r.db"
    assert main(ARCH + ["--tmp-dir", str(work), "--db", str(db_path)]) == 0
    assert "4 ok" in capsys.readouterr().out
    assert not list(work.iterdir())   # each synthetic checkpoint is deleted after its unit
    with ResultsDB(db_path) as db:
        rows = db.rows("model")
        assert sorted((r.case["top_k"], r.case["batch"]) for r in rows) == [(1, 1), (1, 2), (2, 1), (2, 2)]
        for r in rows:
            c, m = r.case, r.metrics
            assert (c["layers"], c["hidden"], c["inter"], c["experts"], c["format"], c["impl"]) == (
                1, 64, 32, 4, "bf16", "fused")
            assert m["ttft_ms"] > 0 and m["decode_tok_s"] > 0 and m["prefill_tok_s"] > 0 and m["peak_rss_gb"] > 0
            assert m["itl_ms"] == pytest.approx((m["e2e_s"] * 1e3 - m["ttft_ms"]) / (c["batch"] * 2))
            assert r.bandwidth_gbs > 0 and r.mm_gflops > 0
    assert main(ARCH + ["--tmp-dir", str(work), "--db", str(db_path)]) == 0
    assert "4 skipped" in capsys.readouterr().out


def test_arch_model_too_large_is_not_built(tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    assert main(ARCH + ["--tmp-dir", str(work), "--max-memory-gb", "0.05", "--db", str(tmp_path / "r.db")]) == 0
    assert "4 oom" in capsys.readouterr().out and not list(work.iterdir())


@pytest.mark.slow
def test_model_sweep_over_formats_and_impls(tmp_path, capsys):
    from cpumoe.loader.quantized.convert import quantize_checkpoint
    bf16 = make_checkpoint("qwen3-30b-a3b", tmp_path / "tiny", layers=1, vocab=300, dtype=torch.bfloat16,
                           overrides=tiny_overrides("qwen3-30b-a3b"))
    int8 = quantize_checkpoint(bf16, tmp_path / "tiny-int8", "int8").path
    db_path = tmp_path / "r.db"
    args = ["bench", "sweep", "model", str(bf16), str(int8), "--batch", "1,2", "--input-len", "8", "--output-len",
            "2", "--experts", "fused,naive", "--threads", "1", "--db", str(db_path)]
    assert main(args) == 0
    assert "8 ok" in capsys.readouterr().out
    with ResultsDB(db_path) as db:
        got = sorted((r.case["model"], r.case["format"], r.case["impl"], r.case["batch"]) for r in db.rows("model"))
        assert got == sorted((m, f, i, b) for m, f in (("tiny", "bf16"), ("tiny-int8", "int8"))
                             for i in ("fused", "naive") for b in (1, 2))
        assert all(r.case["layers"] is None and r.case["experts"] == 4 for r in db.rows("model"))


def test_model_sweep_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit, match="cpumoe bench sweep model: error: .*does not exist"):
        main(["bench", "sweep", "model", str(tmp_path / "nope"), "--batch", "1", "--input-len", "4",
              "--output-len", "2"])
    with pytest.raises(SystemExit, match="cpumoe bench sweep arch-model: error: no synthetic checkpoint"):
        main(["bench", "sweep", "arch-model", "--skeleton", "no-such-model"])
    with pytest.raises(SystemExit, match="arch-model: error: phimoe: sparsemixer routes every token to 2 experts"):
        main(["bench", "sweep", "arch-model", "--skeleton", "phi-3.5-moe"])   # the paper grid's top-k axis has 1
    with pytest.raises(SystemExit, match="--vocab must be at least 259"):
        main(ARCH + ["--vocab", "100"])
    with pytest.raises(SystemExit) as exit_:
        main(ARCH + ["--batch", "0"])
    assert exit_.value.code == 2 and "expected positive integers" in capsys.readouterr().err
