"""`cpumoe bench serve` against a real `cpumoe serve` of a tiny synthetic checkpoint: every request completes with
exactly the output length asked (the server honours ignore_eos and reports usage), on both endpoints."""
import json
import subprocess
import sys

import pytest
import torch

from cpumoe.bench.results import ResultsDB
from cpumoe.cli import main
from cpumoe.synthetic.checkpoint import make_checkpoint, tiny_overrides
from tests.server.test_serve_cli import _free_port, _wait_up


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = make_checkpoint("qwen3-30b-a3b", tmp_path_factory.mktemp("bench_serve"), layers=2, vocab=400,
                                 dtype=torch.bfloat16, overrides=tiny_overrides("qwen3-30b-a3b"))
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cpumoe", "serve", str(checkpoint), "--port", str(port),
                             "--kv-cache-gb", "0.05", "--max-num-seqs", "4", "--served-model-name", "tiny",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_up(proc, port)
        yield f"http://127.0.0.1:{port}", checkpoint
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_request_completes_with_the_asked_output_length(server, tmp_path, endpoint, capsys):
    url, checkpoint = server
    out = tmp_path / "r.json"
    code = main(["bench", "serve", "--base-url", url, "--tokenizer", str(checkpoint), "--endpoint", endpoint,
                 "--input-len", "16:48", "--output-len", "12", "--num-prompts", "8", "--request-rate", "20",
                 "--max-concurrency", "4", "--db", str(tmp_path / "r.db"), "--json", str(out), "--no-ceiling"])
    result = json.loads(out.read_text())
    assert code == 0 and result["completed"] == 8 and result["failed"] == 0, result["errors"]
    assert result["model_id"] == "tiny" and result["output_lens"] == [12] * 8
    assert all(16 <= n <= 48 for n in result["input_lens"])
    assert all(len(itls) >= 1 for itls in result["itls"]) and result["mean_tpot_ms"] > 0
    assert "warning" not in capsys.readouterr().out
    with ResultsDB(tmp_path / "r.db") as db:
        (row,) = db.rows("serve")
    assert row.case["model"] == "tiny" and row.case["input_len"] == "16:48" and row.metrics["completed"] == 8
