"""`cpumoe bench throughput` on a tiny checkpoint: every budget runs the same load, every prompt token and output
token is accounted for in the step groups, and bad input is refused clearly."""
import json

import pytest
import torch

from cpumoe.cli import main
from cpumoe.synthetic.checkpoint import make_checkpoint, tiny_overrides


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("qwen3-30b-a3b", tmp_path_factory.mktemp("tp") / "ckpt", layers=2, vocab=400,
                           dtype=torch.float32, overrides=tiny_overrides("qwen3-30b-a3b"))


def test_throughput_accounts_for_every_token(checkpoint, tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", str(checkpoint), "--num-prompts", "7", "--max-concurrency", "3",
                 "--input-len", "20", "--output-len", "5", "--max-num-batched-tokens", "8,64", "--repeats", "2",
                 "--quick",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["load"] == {"num_prompts": 7, "max_concurrency": 3, "input_len": 20, "output_len": 5,
                              "temperature": 1.0, "seed": 0}
    runs = report["results"]
    assert [(r["max_num_batched_tokens"], r["repeat"]) for r in runs] == [(8, 0), (64, 0), (8, 1), (64, 1)]
    for r in runs:
        decode, chunk = r["decode_steps"], r["prefill_steps"]
        assert r["output_tokens"] == 7 * 5
        assert r["steps"] == decode["steps"] + chunk["steps"]
        # every prompt token computed once (no preemption, no prefix caching between runs of the same prompts)
        assert chunk["prefill_tokens"] == 7 * 20 and decode["prefill_tokens"] == 0
        # each request's first token comes from its last prompt chunk, the 4 others from a decode each
        assert decode["decodes"] + chunk["decodes"] == 7 * 4
        assert r["output_tok_s"] > 0 and r["mean_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0
        # every step has a floor: the run's bound is the output over their sum, at the probes around the run
        assert decode["floor_s"] > 0 and chunk["floor_s"] > 0 and r["bandwidth_gbs"] > 0 and r["gemm_gflops"] > 0
        assert r["bound_tok_s"] == pytest.approx(r["output_tokens"] / (decode["floor_s"] + chunk["floor_s"]))
    small = next(r for r in runs if r["max_num_batched_tokens"] == 8)
    large = next(r for r in runs if r["max_num_batched_tokens"] == 64)
    # 8 tokens a step: a 20-token prompt needs 3 chunks at least, and decodes ride on most of them
    assert small["prefill_steps"]["steps"] >= -(-7 * 20 // 8) and small["prefill_steps"]["decodes"] > 0
    # 64: a step takes the 3 prompts in flight whole; they finish together, and so do the next 3: 3 chunk steps
    assert large["prefill_steps"]["steps"] == 3 and large["prefill_steps"]["decodes"] == 0
    text = capsys.readouterr().out
    assert "decode steps" in text and "the highest median" in text and "bound tok/s" in text


def test_throughput_refuses_bad_input(checkpoint, tmp_path):
    with pytest.raises(SystemExit, match="no such|does not exist|not a directory|config.json"):
        main(["bench", "throughput", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="--temperature must be >= 0"):
        main(["bench", "throughput", str(checkpoint), "--temperature", "-1"])
    with pytest.raises(SystemExit):   # argparse: not a positive integer
        main(["bench", "throughput", str(checkpoint), "--max-num-batched-tokens", "0"])
