# The OpenAI-compatible server over a fake engine (deterministic words, small sleeps, records params and aborts), run
# by uvicorn on a loopback port in a background thread and driven by the official `openai` client; raw httpx for
# what the client will not send (malformed JSON, missing fields, no key).
import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cpumoe.engine.api import RequestOutput, SamplingParams
from cpumoe.server import create_app
from cpumoe.synthetic.tokenizer import make_tokenizer
from tests.server.serving import running_server

MODEL = "fake-moe"
KEY = "test-key"
MAX_MODEL_LEN = 256
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon"]


class FakeEngine:
    """Generates " alpha beta gamma ..." (starting at WORDS[seed % 5]), one word a step with a small sleep;
    honours max_tokens and stop strings; records each request's params, and which requests finished or were
    aborted."""
    model_name = MODEL
    max_model_len = MAX_MODEL_LEN

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.params: dict[str, SamplingParams] = {}
        self.prompts: dict[str, list[int]] = {}
        self.running: set[str] = set()
        self.finished: set[str] = set()
        self.aborted: set[str] = set()

    async def generate(self, request_id, prompt_token_ids, params):
        self.params[request_id], self.prompts[request_id] = params, list(prompt_token_ids)
        self.running.add(request_id)
        try:
            start = (params.seed or 0) % len(WORDS)
            text = ""
            for i in range(params.max_tokens):
                await asyncio.sleep(0.002)
                word = " " + WORDS[(start + i) % len(WORDS)]
                cuts = [(text + word).find(s) for s in params.stop if s in text + word]
                if cuts:   # a stop string: the text up to it, without it
                    self.finished.add(request_id)
                    yield RequestOutput(request_id, [100 + i], (text + word)[len(text):max(min(cuts), len(text))],
                                        finished=True, finish_reason="stop", prompt_tokens=len(prompt_token_ids),
                                        completion_tokens=i + 1)
                    return
                text += word
                last = i == params.max_tokens - 1
                if last:
                    self.finished.add(request_id)
                yield RequestOutput(request_id, [100 + i], word, finished=last,
                                    finish_reason="length" if last else None,
                                    prompt_tokens=len(prompt_token_ids), completion_tokens=i + 1)
        finally:
            self.running.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)
        self.running.discard(request_id)

    def stats(self) -> dict:
        return dict(running=len(self.running), waiting=0, kv_blocks_used=len(self.running), kv_blocks_total=64)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(path, 1000)
    return FakeEngine(AutoTokenizer.from_pretrained(path))


@pytest.fixture(scope="module")
def base_url(engine):
    with running_server(create_app(engine, model_name=MODEL, api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=20) as c:
        yield c


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=20) as c:
        yield c


def _wait_for(condition, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


# ---- the happy paths --------------------------------------------------------------------------------------------

def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model" and models[0].max_model_len == MAX_MODEL_LEN


def test_completion(client, engine):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].text == " alpha beta gamma"
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(engine.tokenizer.encode("Hello there"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 3, n_prompt + 3)
    assert engine.prompts[r.id] == engine.tokenizer.encode("Hello there")
    assert r.id in engine.finished and r.id not in engine.aborted


@pytest.mark.parametrize("stop", [" gamma", [" delta", " gamma"]], ids=["str", "list"])
def test_completion_stop(client, engine, stop):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=10, stop=stop)
    assert r.choices[0].text == " alpha beta"
    assert r.choices[0].finish_reason == "stop"
    assert engine.params[r.id].stop == ([stop] if isinstance(stop, str) else stop)


def test_completion_token_ids_prompt(client, engine):
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=2)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 2
    assert engine.prompts[r.id] == [5, 6, 7, 8]


def test_sampling_params_passthrough(client, engine):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, seed=2, temperature=0.5, top_p=0.9,
                                  extra_body={"top_k": 7})
    assert r.choices[0].text == " gamma delta"   # the fake starts at WORDS[seed % 5]
    p = engine.params[r.id]
    assert (p.seed, p.temperature, p.top_p, p.top_k, p.max_tokens) == (2, 0.5, 0.9, 7, 2)


def test_completion_stream(client, engine):
    stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == " alpha beta gamma delta" and len(texts) == 4
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 4
    assert len({c.id for c in chunks}) == 1 and chunks[0].id in engine.finished


class HeldTextEngine(FakeEngine):
    """FakeEngine whose every other step ends inside a character: that step's text comes with the next one."""

    async def generate(self, request_id, prompt_token_ids, params):
        held = ""
        async for out in super().generate(request_id, prompt_token_ids, params):
            step = len(out.new_token_ids) and out.completion_tokens
            if step % 2 == 1 and not out.finished:
                held, out.new_text = out.new_text, ""
            else:
                held, out.new_text = "", held + out.new_text
            yield out


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_step_without_text_still_streams_a_chunk(engine, endpoint):
    """One chunk per step that made tokens, its text empty while a character is incomplete (as vLLM streams): a
    client times every step, and the text is whole once joined."""
    held = HeldTextEngine(engine.tokenizer)
    with running_server(create_app(held, model_name=MODEL)) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=20) as c:
        if endpoint == "completions":
            chunks = [ch for ch in c.completions.create(model=MODEL, prompt="Hi", max_tokens=5, stream=True)]
            texts = [ch.choices[0].text for ch in chunks if ch.choices]
        else:
            chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=5, stream=True))
            texts = [ch.choices[0].delta.content for ch in chunks[1:] if ch.choices and not ch.choices[0].finish_reason]
    assert "".join(texts) == " alpha beta gamma delta epsilon"
    assert len(texts) == 5 and texts[0] == "" and texts[2] == ""


def test_chat(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three letters."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, seed=1)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == " beta gamma delta"
    assert r.choices[0].finish_reason == "length"
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert engine.prompts[r.id] == list(ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 3)
    assert engine.params[r.id].seed == 1


def test_chat_default_max_tokens_fills_the_context(client, engine):
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, stop=" epsilon")
    n_prompt = r.usage.prompt_tokens
    assert engine.params[r.id].max_tokens == MAX_MODEL_LEN - n_prompt
    assert r.choices[0].message.content == " alpha beta gamma delta" and r.choices[0].finish_reason == "stop"


def test_chat_stream(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, stop=[" delta"], stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == " alpha beta gamma"
    with_reason = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(with_reason) == 1 and with_reason[0].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_sse_wire_format(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0].removeprefix("data: "))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    second = json.loads(lines[1].removeprefix("data: "))
    assert second["choices"][0]["delta"] == {"content": " alpha"} and second["choices"][0]["finish_reason"] is None


def test_concurrent_streams(client, engine):
    n_clients = 32
    results: dict[int, tuple[str, str, str]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"#{i}"}],
                                                    max_tokens=12, seed=i, stream=True)
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            results[i] = (chunks[0].id, text, chunks[-1].choices[0].finish_reason)
        except BaseException as e:   # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert sorted(results) == list(range(n_clients))
    for i, (request_id, text, reason) in results.items():
        expected = "".join(" " + WORDS[(i + j) % len(WORDS)] for j in range(12))
        assert text == expected, f"client {i}"
        assert reason == "length" and request_id in engine.finished
    assert len({r[0] for r in results.values()}) == n_clients


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_closing_a_stream_aborts_the_request(client, engine, kind):
    if kind == "chat":
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=200, stream=True)
    else:
        stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=200, stream=True)
    iterator = iter(stream)
    first = next(iterator)
    next(iterator)
    stream.close()
    assert _wait_for(lambda: first.id in engine.aborted), "closing the stream did not abort the request"
    assert first.id not in engine.finished
    assert _wait_for(lambda: first.id not in engine.running)
    # and the server goes on serving
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices[0].text == " alpha"


# ---- bad input --------------------------------------------------------------------------------------------------

COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

BAD_REQUESTS = {
    # id: (path, body (bytes: sent raw), status, param)
    "malformed-json": ("/v1/completions", b'{"model": "fake-moe", "prompt": ', 400, None),
    "not-an-object": ("/v1/completions", b'["fake-moe"]', 400, None),
    "empty-body": ("/v1/chat/completions", b"", 400, None),
    "missing-model": ("/v1/completions", {"prompt": "Hi"}, 400, "model"),
    "missing-prompt": ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    "prompt-wrong-type": ("/v1/completions", {**COMPLETION, "prompt": 5}, 400, None),
    "empty-prompt": ("/v1/completions", {**COMPLETION, "prompt": ""}, 400, "prompt"),
    "token-id-out-of-vocab": ("/v1/completions", {**COMPLETION, "prompt": [1, 10**6]}, 400, "prompt"),
    "missing-messages": ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    "empty-messages": ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    "message-without-role": ("/v1/chat/completions", {**CHAT, "messages": [{"content": "Hi"}]}, 400, None),
    "unknown-model": ("/v1/completions", {**COMPLETION, "model": "gpt-9"}, 404, "model"),
    "unknown-model-chat": ("/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model"),
    "prompt-too-long": ("/v1/completions", {**COMPLETION, "prompt": [7] * MAX_MODEL_LEN}, 400, "prompt"),
    "prompt-plus-max-tokens": ("/v1/completions", {**COMPLETION, "prompt": [7] * 10,
                                                   "max_tokens": MAX_MODEL_LEN - 9}, 400, "max_tokens"),
    "chat-prompt-plus-max-tokens": ("/v1/chat/completions", {**CHAT, "max_tokens": MAX_MODEL_LEN}, 400,
                                    "max_tokens"),
    "max-tokens-zero": ("/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    "max-tokens-negative": ("/v1/chat/completions", {**CHAT, "max_tokens": -3}, 400, "max_tokens"),
    "max-completion-tokens-zero": ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400,
                                   "max_completion_tokens"),
    "temperature-negative": ("/v1/completions", {**COMPLETION, "temperature": -0.5}, 400, "temperature"),
    "top-p-zero": ("/v1/completions", {**COMPLETION, "top_p": 0}, 400, "top_p"),
    "top-p-above-one": ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p"),
    "top-k-negative": ("/v1/completions", {**COMPLETION, "top_k": -2}, 400, "top_k"),
    "n-two": ("/v1/completions", {**COMPLETION, "n": 2}, 400, "n"),
    "n-two-chat": ("/v1/chat/completions", {**CHAT, "n": 2}, 400, "n"),
    "stop-wrong-type": ("/v1/completions", {**COMPLETION, "stop": 3}, 400, None),
    "stream-string": ("/v1/completions", {**COMPLETION, "stream": "yes"}, 400, "stream"),
    "max-tokens-bool": ("/v1/completions", {**COMPLETION, "max_tokens": True}, 400, "max_tokens"),
    "temperature-string": ("/v1/chat/completions", {**CHAT, "temperature": "0.5"}, 400, "temperature"),
    "prompt-bool-ids": ("/v1/completions", {**COMPLETION, "prompt": [True]}, 400, None),
    "seed-too-large": ("/v1/completions", {**COMPLETION, "seed": 2**64}, 400, "seed"),
    "seed-too-small": ("/v1/chat/completions", {**CHAT, "seed": -(2**63) - 1}, 400, "seed"),
    "five-stops": ("/v1/completions", {**COMPLETION, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    "long-stop": ("/v1/chat/completions", {**CHAT, "stop": "x" * 1025}, 400, "stop"),
    # JSON's \uXXXX escapes can name a lone surrogate, which no UTF-8 text holds (json.dumps writes the escape)
    "lone-surrogate-prompt": ("/v1/completions", json.dumps({**COMPLETION, "prompt": "Hi \ud800"}).encode(), 400,
                              "prompt"),
    "lone-surrogate-chat": ("/v1/chat/completions",
                            json.dumps({**CHAT, "messages": [{"role": "user", "content": "\udfff"}]}).encode(), 400,
                            None),
    "lone-surrogate-stop": ("/v1/completions", json.dumps({**COMPLETION, "stop": ["\ud800"]}).encode(), 400, "stop"),
    "unknown-route": ("/v1/embeddings", COMPLETION, 404, None),
    # OpenAI fields cpumoe does not implement: a 400 that names them, never a 200 that ignores them
    "tools": ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
              "tools"),
    "tool-choice": ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    "functions": ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    "json-mode": ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400,
                  "response_format"),
    "top-logprobs": ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    "chat-logprobs": ("/v1/chat/completions", {**CHAT, "logprobs": True}, 400, "logprobs"),
    "presence-penalty": ("/v1/completions", {**COMPLETION, "presence_penalty": 0.5}, 400, "presence_penalty"),
    "frequency-penalty": ("/v1/chat/completions", {**CHAT, "frequency_penalty": -1.0}, 400, "frequency_penalty"),
    "logit-bias": ("/v1/completions", {**COMPLETION, "logit_bias": {"50256": -100}}, 400, "logit_bias"),
    "suffix": ("/v1/completions", {**COMPLETION, "suffix": "end"}, 400, "suffix"),
    "n": ("/v1/chat/completions", {**CHAT, "n": 2}, 400, "n"),
}


def test_unimplemented_fields_at_their_off_values_pass(http):
    """What clients send by default for the fields cpumoe does not implement is accepted."""
    off = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "n": 1}
    r = http.post("/v1/chat/completions", json={**CHAT, **off, "tool_choice": "none", "logprobs": False,
                                                "top_logprobs": 0, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json={**COMPLETION, **off, "suffix": None, "echo": False, "best_of": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_request(http, case):
    path, body, status, param = BAD_REQUESTS[case]
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    # the server keeps serving
    ok = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == " alpha"


def test_bad_request_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)
    assert info.value.status_code == 400 and info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}])
    assert info.value.body["code"] == "model_not_found"


def test_api_key(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong-key", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    with httpx.Client(base_url=base_url) as anonymous:
        for path in ("/v1/models", "/v1/completions"):
            r = anonymous.post(path, content=b"{oops") if path.endswith("completions") else anonymous.get(path)
            assert r.status_code == 401, path   # the key is checked before the body is parsed
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/metrics").status_code == 200


def test_no_api_key_means_open(engine):
    from fastapi.testclient import TestClient
    with TestClient(create_app(engine, model_name=MODEL)) as open_client:
        assert open_client.get("/v1/models").json()["data"][0]["id"] == MODEL


# ---- health and metrics -----------------------------------------------------------------------------------------

def _metrics(http) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {s.name + json.dumps(s.labels, sort_keys=True) * bool(s.labels): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_health(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_metrics(http, client):
    before = _metrics(http)
    for name in ("cpumoe_time_to_first_token_seconds", "cpumoe_inter_token_latency_seconds",
                 "cpumoe_e2e_request_latency_seconds"):
        assert f"{name}_count" in before and f"{name}_sum" in before, name
        assert any(k.startswith(f"{name}_bucket") for k in before), name
    for name in ("cpumoe_num_requests_running", "cpumoe_num_requests_waiting", "cpumoe_kv_blocks_used",
                 "cpumoe_kv_blocks_total"):
        assert name in before, name
    assert before["cpumoe_kv_blocks_total"] == 64

    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5)
    after = _metrics(http)
    assert after["cpumoe_prompt_tokens_total"] - before["cpumoe_prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["cpumoe_generation_tokens_total"] - before["cpumoe_generation_tokens_total"] == 5
    assert after["cpumoe_time_to_first_token_seconds_count"] - before["cpumoe_time_to_first_token_seconds_count"] == 1
    assert after["cpumoe_inter_token_latency_seconds_count"] - before["cpumoe_inter_token_latency_seconds_count"] == 4
    assert after["cpumoe_e2e_request_latency_seconds_count"] - before["cpumoe_e2e_request_latency_seconds_count"] == 1
    length = 'cpumoe_requests_total{"finish_reason": "length"}'
    assert after[length] - before.get(length, 0) == 1


def test_metrics_gauges_follow_the_engine(http, client, engine):
    stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=200, stream=True)
    iterator = iter(stream)
    next(iterator)
    assert _metrics(http)["cpumoe_num_requests_running"] >= 1
    stream.close()
    assert _wait_for(lambda: _metrics(http)["cpumoe_num_requests_running"] == 0)


def test_cli_serve_rejects_bad_port(capsys):
    from cpumoe.cli import main
    with pytest.raises(SystemExit) as info:
        main(["serve", "some-model", "--port", "0"])
    assert "--port" in str(info.value.code)


# ---- one request never stalls another -----------------------------------------------------------------------------

def test_a_body_over_the_limit_is_a_413_and_the_server_serves_on(engine):
    with running_server(create_app(engine, model_name=MODEL, max_request_bytes=4096)) as url:
        with httpx.Client(base_url=url, timeout=20) as http:
            big = {"model": MODEL, "prompt": "word " * 2000, "max_tokens": 1}
            r = http.post("/v1/completions", json=big)   # Content-Length says so: refused unread
            assert r.status_code == 413, r.text
            error = r.json()["error"]
            assert error["code"] == "request_too_large" and "4096 bytes" in error["message"]

            def chunked():   # no Content-Length: refused once the bytes read pass the limit
                for _ in range(20):
                    yield b" " * 1024
            r = http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == " alpha"


class _BlockingTokenizer:
    """A tokenizer whose encode and chat template block until the test releases them (as a long prompt's
    tokenization keeps its thread busy); `entered` is set once a call is blocking."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.entered, self.released = threading.Event(), threading.Event()

    def _block(self) -> None:
        self.entered.set()
        assert self.released.wait(30), "never released"

    def encode(self, text):
        self._block()
        return self.inner.encode(text)

    def apply_chat_template(self, *args, **kwargs):
        self._block()
        return self.inner.apply_chat_template(*args, **kwargs)

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):   # the rest (get_vocab, ...) as the tokenizer it wraps
        return getattr(self.inner, name)


class _RecordingTokenizer(_BlockingTokenizer):
    """Records the length of every text it encodes, blocking nothing."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.released.set()
        self.lengths: list[int] = []

    def encode(self, text):
        self.lengths.append(len(text))
        return self.inner.encode(text)


def test_a_prompt_of_megabytes_is_refused_after_tokenizing_a_context_of_it(engine):
    """A token spans at most the vocabulary's longest string, so of a 5 MB prompt only max_model_len such tokens'
    worth is tokenized before the 400 (the whole of it took seconds of a core); a prompt that fits is tokenized
    whole, as before."""
    tokenizer = _RecordingTokenizer(engine.tokenizer)
    longest = max(map(len, tokenizer.get_vocab()))
    with running_server(create_app(FakeEngine(tokenizer), model_name=MODEL)) as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "lorem ipsum " * 400_000, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert tokenizer.lengths == [MAX_MODEL_LEN * longest + 1]
            fits = "word " * 20
            assert http.post("/v1/completions", json={"model": MODEL, "prompt": fits, "max_tokens": 1}).status_code == 200
            assert tokenizer.lengths[-1] == len(fits)
            tokenizer.lengths.clear()
            chat = [{"role": "user", "content": "lorem ipsum " * 200_000}, {"role": "user", "content": "more"}]
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert tokenizer.lengths == [MAX_MODEL_LEN * longest + 1]


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "long"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_tokenizing_does_not_stall_other_requests(engine, path, body):
    """While one request's tokenization is busy, /health answers: tokenization runs off the event loop (on it,
    /health could not answer until the tokenizer is released, which happens only after /health has answered)."""
    tokenizer = _BlockingTokenizer(engine.tokenizer)
    with running_server(create_app(FakeEngine(tokenizer), model_name=MODEL)) as url:
        with httpx.Client(base_url=url, timeout=20) as http:
            done = []
            worker = threading.Thread(target=lambda: done.append(
                http.post(path, json={"model": MODEL, "max_tokens": 1, **body}).status_code))
            worker.start()
            assert tokenizer.entered.wait(20)
            try:
                assert http.get("/health", timeout=5).status_code == 200
            finally:
                tokenizer.released.set()
                worker.join(20)
    assert done == [200]


def test_server_runs_on_asyncio_s_own_loop(engine):
    """uvicorn takes uvloop wherever it is installed; the server asks for asyncio's loop, which decoded 16 streams in
    shorter steps here (README, "Serving under load")."""
    from cpumoe.server.run import server_config
    app = create_app(engine, model_name=MODEL)
    assert server_config(app, "127.0.0.1", 0, log_level="warning").loop == "asyncio"


def test_half_open_connections_are_closed_and_slow_answers_are_not(engine, monkeypatch):
    """A client that sends part of a header and stops is disconnected after the header timeout, on a new connection
    and on a kept-alive one; a response that takes longer than the timeout is not cut."""
    import socket

    from cpumoe.server.run import HeaderTimeoutH11, server_config
    monkeypatch.setattr(HeaderTimeoutH11, "header_timeout", 0.2)
    app = create_app(engine, model_name=MODEL)
    with running_server(app, server_config(app, "127.0.0.1", 0, log_level="warning")) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as half_open:
            half_open.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
            assert half_open.recv(1) == b""   # closed by the server, not a recv timeout
        with socket.create_connection(("127.0.0.1", port), timeout=10) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):   # the headers and the body may come apart
                chunk = kept.recv(4096)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200")
            kept.sendall(b"GET /health HTTP/1.1\r\nHo")
            assert kept.recv(1) == b""
        with httpx.Client(base_url=url, timeout=20) as http:   # 250 words at 2 ms: longer than the timeout
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 250})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 250


def test_the_open_file_limit_is_raised_to_the_hard_limit():
    import resource

    from cpumoe.server.run import raise_open_file_limit
    soft = raise_open_file_limit()
    now, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == now and (now == hard or hard == resource.RLIM_INFINITY)


def test_serve_starts_with_the_start_up_heap_frozen(engine, monkeypatch):
    """`serve` moves what loading made out of the garbage collector's full passes before it takes requests."""
    import gc

    from cpumoe.server import run
    seen = []
    monkeypatch.setattr(run.DrainingServer, "run", lambda self, sockets=None: seen.append(gc.get_freeze_count()))
    try:
        gc.unfreeze()
        with socket.socket() as sock:
            run.serve(engine, port=0, model_name=MODEL, sock=sock)
    finally:
        gc.unfreeze()
    assert seen and seen[0] > 1000
