"""`cpumoe bench serve` end to end against the fake server: the schedule it streams on comes back in the metrics,
arrivals follow the seeded schedule, concurrency is capped, failures are counted and grouped, the JSON file has
vLLM's keys, the database gets one `serve` row per rate, and bad flags end with a clear error.

Timing checks use bounds that only a broken client can cross: a token cannot arrive before the server sends it,
and the upper bounds leave seconds of slack for a loaded machine."""
import json
import re
import socket

import numpy as np
import pytest

from cpumoe.bench.results import ResultsDB
from cpumoe.bench.serve.ceiling import client_ceiling
from cpumoe.bench.serve.client import arrival_offsets
from cpumoe.cli import main
from tests.bench.serve.fake_server import MODEL

SLACK_S = 3.0          # upper-bound slack for a loaded machine
EARLY_S = 0.005        # timer granularity: a sleep may end this much before its deadline

VLLM_KEYS = {"date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
             "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "input_lens",
             "output_lens", "ttfts", "itls", "generated_texts", "errors"} | {
    f"{stat}_{name}_ms" for stat in ("mean", "median", "std", "p90", "p99") for name in ("ttft", "tpot", "itl", "e2el")}


def _bench(url, tmp_path, *extra, tokenizer=None, ceiling=False):
    argv = ["bench", "serve", "--base-url", url, "--db", str(tmp_path / "r.db"), "--json", str(tmp_path / "r.json"),
            "--input-len", "8", "--output-len", "6", "--num-prompts", "4", *extra]
    if tokenizer is not None:
        argv += ["--tokenizer", str(tokenizer)]
    if not ceiling:
        argv.append("--no-ceiling")
    code = main(argv)
    return code, json.loads((tmp_path / "r.json").read_text())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_metrics_follow_the_servers_schedule(fake, tmp_path, tokenizer_dir, endpoint, capsys):
    server, url = fake
    server.ttft_s, server.step_s = 0.15, 0.03
    code, result = _bench(url, tmp_path, "--endpoint", endpoint, tokenizer=tokenizer_dir)
    assert code == 0 and result["completed"] == 4 and result["failed"] == 0
    assert result["output_lens"] == [6] * 4 and result["input_lens"] == [8] * 4
    assert result["total_output_tokens"] == 24 and result["total_input_tokens"] == 32
    assert result["backend"] == ("openai" if endpoint == "completions" else "openai-chat")
    assert result["model_id"] == MODEL and all(b["model"] == MODEL for b in server.bodies)
    for ttft, itls in zip(result["ttfts"], result["itls"]):
        assert 0.15 - EARLY_S <= ttft <= 0.15 + SLACK_S
        assert len(itls) == 5                       # 6 token chunks; the chat role chunk is not one
        assert 0.15 + 5 * 0.03 - EARLY_S <= ttft + sum(itls) <= 0.3 + SLACK_S
    # a late first chunk shortens E2E - TTFT by its delay: allow one of 60 ms
    assert 0.03 - 0.06 / 5 <= result["median_tpot_ms"] / 1000 <= 0.03 + SLACK_S
    # TPOT is (E2E - TTFT) / 5, and the gaps of a request sum to E2E - TTFT: the mean ITL is the mean TPOT
    assert result["mean_itl_ms"] == pytest.approx(result["mean_tpot_ms"], rel=1e-6)
    assert result["mean_e2el_ms"] == pytest.approx(result["mean_ttft_ms"] + 5 * result["mean_tpot_ms"], rel=1e-6)
    body = server.bodies[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"] == 6
    out = capsys.readouterr().out
    assert "output lengths from: usage (4 requests)" in out and "ITL: every gap" in out and "warning" not in out


def test_json_has_vllm_keys_and_db_gets_a_serve_row(fake, tmp_path, tokenizer_dir):
    server, url = fake
    code, result = _bench(url, tmp_path, "--seed", "3", "--label", "fake", "--max-concurrency", "3",
                          tokenizer=tokenizer_dir)
    assert VLLM_KEYS <= set(result) and result["request_rate"] == "inf" and result["max_concurrency"] == 3
    assert result["tokenizer_id"] == str(tokenizer_dir) and result["request_goodput"] is None
    assert all(len(result[k]) == 4 for k in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts",
                                             "errors"))
    assert result["generated_texts"] == [" t" * 6] * 4 and result["errors"] == [""] * 4
    with ResultsDB(tmp_path / "r.db") as db:
        (row,) = db.rows("serve")
    assert row.status == "ok"
    assert row.case == {"label": "fake", "base_url": url, "model": MODEL, "endpoint": "completions",
                        "dataset": "random", "input_len": 8, "output_len": 6, "num_prompts": 4, "request_rate": "inf",
                        "burstiness": 1.0, "max_concurrency": 3, "seed": 3}
    for key in ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "p99_itl_ms", "median_e2el_ms", "request_goodput"):
        assert row.metrics[key] == result[key], key
    assert "ttfts" not in row.metrics and row.metrics["output_len_mismatches"] == 0


def test_max_concurrency_caps_the_streams_in_flight(fake, tmp_path, tokenizer_dir):
    server, url = fake
    server.ttft_s, server.step_s = 0.05, 0.02
    code, result = _bench(url, tmp_path, "--num-prompts", "8", "--max-concurrency", "2", tokenizer=tokenizer_dir)
    assert result["completed"] == 8 and server.peak_streams == 2


def test_without_a_cap_every_request_is_in_flight(fake, tmp_path, tokenizer_dir):
    server, url = fake
    server.ttft_s, server.step_s = 0.5, 0.05
    _bench(url, tmp_path, "--num-prompts", "6", tokenizer=tokenizer_dir)
    assert server.peak_streams == 6


def test_failed_requests_are_counted_and_grouped(fake, tmp_path, tokenizer_dir, capsys):
    server, url = fake
    server.fail = lambda i, body: (500, "boom") if i % 3 == 0 else (400, "bad prompt") if i == 4 else None
    code, result = _bench(url, tmp_path, "--num-prompts", "7", tokenizer=tokenizer_dir)
    assert code == 0 and result["completed"] == 3 and result["failed"] == 4
    failed = [e for e in result["errors"] if e]
    assert sorted(failed) == ["HTTP 400: bad prompt"] + ["HTTP 500: boom"] * 3
    assert sum(n == 0 for n in result["output_lens"]) == 4
    out = capsys.readouterr().out
    assert "3 x HTTP 500: boom" in out and "1 x HTTP 400: bad prompt" in out
    with ResultsDB(tmp_path / "r.db") as db:
        (row,) = db.rows("serve")
    assert row.status == "ok" and row.metrics["first_errors"] == ["3 x HTTP 500: boom", "1 x HTTP 400: bad prompt"]


@pytest.mark.parametrize("cut_off,error", [(False, "stream error: engine died"),
                                           (True, "the stream ended before [DONE], after 2 token chunks")])
def test_a_stream_that_breaks_is_a_failure(fake, tmp_path, tokenizer_dir, cut_off, error, capsys):
    server, url = fake
    server.break_after, server.cut_off = 2, cut_off
    _, result = _bench(url, tmp_path, tokenizer=tokenizer_dir)
    assert result["failed"] == 4 and result["errors"] == [error] * 4
    assert f"4 x {error}" in capsys.readouterr().out


def test_all_failed_writes_an_error_row_and_exits_1(fake, tmp_path, tokenizer_dir):
    server, url = fake
    server.fail = lambda i, body: (503, "overloaded")
    code, result = _bench(url, tmp_path, tokenizer=tokenizer_dir)
    assert code == 1 and result["completed"] == 0 and result["mean_ttft_ms"] is None
    with ResultsDB(tmp_path / "r.db") as db:
        assert [r.status for r in db.rows("serve")] == ["error"]


@pytest.mark.parametrize("slos,all_good", [(["ttft:20000", "tpot:20000"], True), (["ttft:1"], False),
                                           (["e2el:20000"], True)])
def test_goodput(fake, tmp_path, tokenizer_dir, slos, all_good):
    server, url = fake
    server.ttft_s = 0.05
    _, result = _bench(url, tmp_path, "--goodput", *slos, tokenizer=tokenizer_dir)
    expected = result["request_throughput"] if all_good else 0.0
    assert result["request_goodput"] == pytest.approx(expected)


def test_rate_sweep_one_row_per_rate_and_seeded_arrivals(fake, tmp_path, tokenizer_dir, capsys):
    server, url = fake
    code, results = _bench(url, tmp_path, "--num-prompts", "10", "--request-rate", "5,inf", "--seed", "5",
                           tokenizer=tokenizer_dir)
    assert [r["request_rate"] for r in results] == [5.0, "inf"] and all(r["completed"] == 10 for r in results)
    # the first 10 arrivals follow the seeded schedule (about 1 s long): relative to the first one, none is early
    # by more than the first request's own delay, none late by more than the slack
    arrivals = np.array(server.arrivals[:10]) - server.arrivals[0]
    offsets = arrival_offsets(10, 5.0, 1.0, seed=5)
    assert offsets[-1] > 0.9 and np.all(arrivals >= offsets - 0.2) and np.all(arrivals <= offsets + SLACK_S)
    with ResultsDB(tmp_path / "r.db") as db:
        assert [r.case["request_rate"] for r in db.rows("serve")] == [5.0, "inf"]
    table = capsys.readouterr().out
    assert re.search(r"^\s+5\s+10\s+0\s", table, re.M) and re.search(r"^\s+inf\s+10\s+0\s", table, re.M)


def test_without_usage_output_is_counted_with_the_tokenizer(fake, tmp_path, tokenizer_dir, capsys):
    server, url = fake
    server.send_usage, server.tokens_per_chunk = False, 3
    _, result = _bench(url, tmp_path, "--output-len", "9", tokenizer=tokenizer_dir)
    assert result["output_lens"] == [9] * 4
    assert all(len(itls) == 2 for itls in result["itls"])    # 3 chunks of 3 tokens: 2 gaps
    assert "output lengths from: tokenizer (4 requests)" in capsys.readouterr().out


def test_output_length_other_than_asked_is_warned(fake, tmp_path, capsys):
    """No usage and no tokenizer (a JSONL dataset): output is counted in chunks, here 3 per 9 tokens."""
    server, url = fake
    server.send_usage, server.tokens_per_chunk = False, 3
    dataset = tmp_path / "p.jsonl"
    dataset.write_text(json.dumps({"prompt": "hello", "output_len": 9}) + "\n")
    _, result = _bench(url, tmp_path, "--dataset", str(dataset))
    assert result["output_lens"] == [3] * 4 and result["input_lens"] == [None] * 4
    out = capsys.readouterr().out
    assert "4 of 4 completed requests got another output length than asked (3 for 9" in out


def test_jsonl_dataset_with_usage_counts_input_from_the_server(fake, tmp_path):
    server, url = fake
    dataset = tmp_path / "p.jsonl"
    dataset.write_text(json.dumps({"prompt": "hello", "output_len": 2}) + "\n" + json.dumps({"prompt": "bye"}) + "\n")
    _, result = _bench(url, tmp_path, "--dataset", str(dataset), "--output-len", "3")
    assert [b["prompt"] for b in server.bodies] == ["hello", "bye"] * 2
    assert [b["max_tokens"] for b in server.bodies] == [2, 3] * 2
    assert result["input_lens"] == [7] * 4 and result["output_lens"] == [2, 3, 2, 3]   # usage's prompt_tokens


def test_no_ignore_eos_sends_neither_field(fake, tmp_path, tokenizer_dir):
    server, url = fake
    server.fail = lambda i, body: (400, "unknown field ignore_eos") if "ignore_eos" in body else None
    _, result = _bench(url, tmp_path, "--no-ignore-eos", "--model", "named", tokenizer=tokenizer_dir)
    assert result["completed"] == 4 and result["model_id"] == "named"
    assert not any("ignore_eos" in b or "min_tokens" in b for b in server.bodies)


def test_ceiling_is_measured_and_reported(fake, tmp_path, tokenizer_dir, capsys):
    _, url = fake
    _bench(url, tmp_path, "--num-prompts", "1", tokenizer=tokenizer_dir, ceiling=True)
    assert "client ceiling: " in capsys.readouterr().out
    with ResultsDB(tmp_path / "r.db") as db:
        assert db.rows("serve")[0].metrics["client_ceiling_chunks_s"] > 0


def test_client_ceiling_streams_every_chunk():
    ceiling = client_ceiling(chunks=5000)
    assert ceiling.chunks == 5000 and ceiling.seconds > 0 and ceiling.chunks_per_s > 0


@pytest.mark.parametrize("flags,message", [
    (["--request-rate", "0"], "a request rate must be positive"),
    (["--request-rate", "2,-1"], "a request rate must be positive"),
    (["--request-rate", "fast"], "expected comma-separated numbers"),
    (["--input-len", "5:2"], "is empty: 5 > 2"),
    (["--output-len", "0"], "positive"),
    (["--goodput", "latency:5"], "NAME one of ttft, tpot, e2el"),
    (["--goodput", "ttft:-5"], "positive number of ms"),
    (["--burstiness", "0"], "positive number"),
    (["--max-concurrency", "0"], "positive integer"),
    (["--num-prompts", "0"], "positive integer"),
])
def test_bad_flags_are_argparse_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "serve", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "cpumoe bench serve: error: argument" in err and message in err


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("case", ["unreachable", "bad url", "no tokenizer", "no dataset", "bad tokenizer"])
def test_bad_inputs_exit_with_a_clear_error(fake, tmp_path, tokenizer_dir, case):
    _, url = fake
    argv = {"unreachable": ["--base-url", f"http://127.0.0.1:{_closed_port()}", "--tokenizer", str(tokenizer_dir)],
            "bad url": ["--base-url", "127.0.0.1:8000"],
            "no tokenizer": ["--base-url", url],
            "no dataset": ["--base-url", url, "--dataset", str(tmp_path / "missing.jsonl")],
            "bad tokenizer": ["--base-url", url, "--tokenizer", str(tmp_path)]}[case]
    expected = {"unreachable": "cannot reach http://127.0.0.1:", "bad url": "--base-url must be http://",
                "no tokenizer": "--dataset random needs a tokenizer", "no dataset": "is not a file",
                "bad tokenizer": "--tokenizer: tokenizer"}[case]
    with pytest.raises(SystemExit) as info:
        main(["bench", "serve", "--no-db", "--no-ceiling", *argv])
    assert str(info.value.code).startswith("cpumoe bench serve: error: ") and expected in str(info.value.code)


def test_the_heap_is_frozen_while_the_load_runs(fake, tmp_path, tokenizer_dir, monkeypatch):
    """The garbage collector's full passes skip what existed before the load (they would pause the client's clock),
    and the heap is as before once it is over."""
    import gc

    from cpumoe.bench.serve import client
    server, url = fake
    server.ttft_s, server.step_s = 0.05, 0.01
    frozen_during = []
    stream_request = client.stream_request

    async def recording(*args):
        frozen_during.append(gc.get_freeze_count())
        await stream_request(*args)
    monkeypatch.setattr(client, "stream_request", recording)
    gc.unfreeze()
    code, result = _bench(url, tmp_path, tokenizer=tokenizer_dir)
    assert code == 0 and result["completed"] == 4
    assert len(frozen_during) == 4 and min(frozen_during) > 1000
    assert gc.get_freeze_count() == 0
