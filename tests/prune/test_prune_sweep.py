"""`cpumoe bench prune` end to end on a tiny synthetic checkpoint: one `prune` row per case plus the unpruned
baseline, quality against the full model, and a case that cannot be pruned recorded as an error."""
import pytest
import torch

from cpumoe.bench.results import ResultsDB
from cpumoe.cli import main

METRICS = {"perplexity", "top1_agreement", "kl_divergence", "decode_tok_s", "prefill_tok_s", "speedup_decode",
           "speedup_prefill", "expert_params"}


@pytest.mark.slow
def test_prune_sweep_rows(tmp_path, capsys):
    from cpumoe.synthetic.checkpoint import make_checkpoint, tiny_overrides
    path = make_checkpoint("qwen3-30b-a3b", tmp_path / "q3", layers=2, vocab=400, dtype=torch.float32,
                           overrides=tiny_overrides("qwen3-30b-a3b"))  # E=4, k=2, I=32
    text = tmp_path / "eval.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\nhello world, this is one more line of text\n")
    db = tmp_path / "r.db"
    assert main(["bench", "prune", str(path), "--ratios", "0.5,0.75", "--text", str(text), "--calibration-random",
                 "64", "--input-len", "8", "--output-len", "3", "--quick", "--repeats", "1", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "pruning sweep" in out and "eval.txt" in out
    rows = ResultsDB(db).rows("prune")
    cases = [(r.case["method"], r.case["ratio"], r.status) for r in rows]
    assert cases == [("none", 0.0, "ok"), ("inter", 0.5, "ok"), ("inter", 0.75, "error"), ("intra", 0.5, "ok"),
                     ("intra", 0.75, "ok")]
    assert all(r.case["model"] == "q3" for r in rows)
    base = rows[0].metrics
    assert METRICS <= set(base) and base["top1_agreement"] == 1.0 and base["kl_divergence"] == 0.0
    assert "would exceed" in rows[2].metrics["message"]
    for r in (rows[1], rows[3], rows[4]):
        m = r.metrics
        assert METRICS <= set(m), r.case
        assert 0 <= m["top1_agreement"] <= 1 and m["kl_divergence"] >= 0 and m["perplexity"] > 1
        assert m["decode_tok_s"] > 0 and m["prefill_tok_s"] > 0 and m["speedup_decode"] > 0
    # 4 experts of 3 x 32 x 64 weights per layer, 2 layers: half of them after either 50% pruning
    assert base["expert_params"] == 2 * 4 * 3 * 32 * 64
    assert rows[1].metrics["expert_params"] == rows[3].metrics["expert_params"] == base["expert_params"] // 2
    assert rows[4].metrics["expert_params"] == base["expert_params"] // 4


def test_prune_sweep_bad_input(tmp_path):
    with pytest.raises(SystemExit):
        main(["bench", "prune", str(tmp_path), "--methods", "inter,outer"])
    with pytest.raises(SystemExit):
        main(["bench", "prune", str(tmp_path), "--ratios", "0.5,1"])
    with pytest.raises(SystemExit, match="cpumoe bench prune: error: .*does not exist"):
        main(["bench", "prune", str(tmp_path / "nope"), "--no-db"])
