"""`cpumoe serve` as a user starts it: a subprocess on a synthetic checkpoint, with the engine-sizing flags, answering
the official openai client, refusing a bad request with a 4xx and serving on; bad flags exit with a clear error."""
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from cpumoe.cli import main  # noqa: E402
from cpumoe.synthetic.checkpoint import make_checkpoint, tiny_overrides  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_up(proc: subprocess.Popen, port: int, log=None) -> None:
    """Until `cpumoe serve` answers /health (it must not exit first, nor take over 120 s). log: the file its
    output goes to, when not to proc.stdout."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"cpumoe serve exited: {log.read_text() if log else proc.stdout.read()}"
        assert time.monotonic() < deadline, "cpumoe serve did not come up in 120 s"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("qwen3-30b-a3b", tmp_path_factory.mktemp("serve_cli"), layers=2, vocab=400,
                           dtype=torch.bfloat16, overrides=tiny_overrides("qwen3-30b-a3b"))


def test_serve_subprocess(checkpoint):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cpumoe", "serve", str(checkpoint), "--port", str(port),
                             "--kv-cache-gb", "0.05", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                             "--served-model-name", "tiny", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, port)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        done = client.completions.create(model="tiny", prompt="Hello there", max_tokens=5, temperature=0)
        assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
        bad = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 0})
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
        again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3)
        assert again.usage.completion_tokens == 3
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_batch_invariant_gives_a_request_the_same_tokens_alone_and_among_others(checkpoint):
    """`cpumoe serve --batch-invariant` through HTTP: a greedy request's token ids alone, then while 7 other requests
    of mixed lengths share its steps under a 32-token budget (its prompt chunked beside their decodes)."""
    import concurrent.futures

    port = _free_port()
    proc = _start(checkpoint, port, "--batch-invariant", "--max-num-batched-tokens", "32", "--max-num-seqs", "8",
                  "--skip-tokenizer-init", env={**os.environ, "CPUMOE_LOG": "info"})
    base = f"http://127.0.0.1:{port}"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (90, 3, 17, 40, 1, 60, 9, 25)]

    def tokens(prompt: list[int]) -> list[int]:
        r = httpx.post(f"{base}/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    try:
        alone = tokens(prompts[0])
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(tokens, prompts[1:4] + prompts[:1] + prompts[4:]))
        assert together[3] == alone and len(alone) == 48
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "batch invariant: every token's attention runs as a row" in out, out


@pytest.mark.parametrize("flag,value", [("--max-num-seqs", "0"), ("--max-num-batched-tokens", "-1"),
                                        ("--kv-cache-gb", "0"), ("--kv-cache-gb", "nan"), ("--kv-cache-gb", "inf"),
                                        ("--kv-cache-gb", "1e9"), ("--max-request-mb", "0")])
def test_serve_rejects_bad_engine_flags(checkpoint, flag, value):
    with pytest.raises(SystemExit) as info:
        main(["serve", str(checkpoint), "--port", str(_free_port()), flag, value])
    message = str(info.value.code).replace("-", "_")
    assert message.startswith("cpumoe serve: error:") and flag.removeprefix("--").replace("-", "_")[:8] in message


def test_serve_takes_its_port_before_loading(tmp_path):
    """A port in use fails at once: the checkpoint (here there is none) is not even looked at."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            main(["serve", str(tmp_path / "no-such-checkpoint"), "--port", str(port)])
    assert str(info.value.code).startswith(f"cpumoe serve: error: cannot listen on 127.0.0.1:{port}")


def test_max_model_len_past_the_trained_positions_needs_consent(checkpoint):
    import json

    from cpumoe.engine import EngineConfig, LLMEngine
    positions = json.loads((checkpoint / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(checkpoint, config=EngineConfig(max_model_len=positions + 1, num_blocks=4))
    engine = LLMEngine(checkpoint, config=EngineConfig(max_model_len=positions + 1, allow_long_max_model_len=True,
                                                       num_blocks=-(-(positions + 1) // 16)))
    assert engine.max_model_len == positions + 1
    with pytest.raises(SystemExit, match="max_position_embeddings"):
        main(["serve", str(checkpoint), "--port", str(_free_port()), "--max-model-len", str(positions + 1)])


def _start(checkpoint, port: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "cpumoe", "serve", str(checkpoint), "--port", str(port),
                             "--kv-cache-gb", "0.05", "--max-num-seqs", "4", "--served-model-name", "tiny", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    _wait_up(proc, port)
    return proc


def test_sigterm_drains_then_ends_the_rest_with_an_error(checkpoint):
    """SIGTERM: new connections are refused, a request that finishes within the grace period finishes, a stream
    that would not gets an error event and [DONE], a non-streaming one a 503; exit status 0, no traceback."""
    import json
    import signal
    import threading

    port = _free_port()
    # long: more tokens than the tiny model makes in the test's ~4 s (about 1 ms each)
    proc = _start(checkpoint, port, "--shutdown-grace-s", "2", "--max-model-len", "40000", "--allow-long-max-model-len")
    base = f"http://127.0.0.1:{port}"
    long = {"model": "tiny", "prompt": "Hello", "max_tokens": 39000, "temperature": 0, "ignore_eos": True}
    results: dict[str, object] = {}

    def stream() -> None:
        with httpx.stream("POST", f"{base}/v1/completions", json={**long, "stream": True}, timeout=120) as r:
            results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    def whole() -> None:
        results["whole"] = httpx.post(f"{base}/v1/completions", json=long, timeout=120)

    def short() -> None:
        results["short"] = httpx.post(f"{base}/v1/completions", json={**long, "max_tokens": 40}, timeout=120)

    threads = [threading.Thread(target=f) for f in (stream, whole)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)           # both are generating
        threads.append(threading.Thread(target=short))
        threads[-1].start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{base}/health", timeout=2)
        for t in threads:
            t.join(60)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    assert results["short"].status_code == 200 and results["short"].json()["usage"]["completion_tokens"] == 40
    assert results["whole"].status_code == 503, results["whole"].text
    assert results["whole"].json()["error"]["code"] == "server_shutting_down"
    events = results["stream"]
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2][len("data: "):])
    assert error["error"]["code"] == "server_shutting_down" and "within 2 s" in error["error"]["message"]
    assert len(events) > 3   # it had streamed tokens before


@pytest.mark.slow
def test_1100_half_open_connections_do_not_lock_out_others(checkpoint):
    """Started under the common soft limit of 1,024 open files: 1,100 connections that send half a request and stop
    neither exhaust the server's descriptors (it raised its soft limit) nor stop /health answering, and after the
    header timeout the server has closed every one of them."""
    import resource

    from cpumoe.server.limits import HEADER_TIMEOUT_S

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200 + 64:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no room for 1,100 connections")
    if soft < 1200 + 64:   # this test's own sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096) if hard != resource.RLIM_INFINITY else 4096,
                                                    hard))
    port = _free_port()

    def common_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    proc = subprocess.Popen([sys.executable, "-m", "cpumoe", "serve", str(checkpoint), "--port", str(port),
                             "--kv-cache-gb", "0.05", "--max-connections", "2000", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=common_limit)
    socks = []
    try:
        _wait_up(proc, port)
        opened = time.monotonic()
        for _ in range(1100):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")     # no blank line: the headers never end
            socks.append(s)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        time.sleep(max(0.0, opened + HEADER_TIMEOUT_S + 2 - time.monotonic()))
        closed = 0
        for s in socks:
            s.settimeout(2)
            try:
                closed += s.recv(1) == b""
            except OSError:
                closed += 1   # reset by the server
        assert closed == len(socks)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        assert proc.poll() is None
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(30)
