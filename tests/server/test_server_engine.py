"""The server over the real engine: a tiny synthetic Qwen3-MoE checkpoint, the official openai client."""
import threading

import openai
import pytest
import torch

from cpumoe.engine import AsyncEngine, LLMEngine
from cpumoe.engine.api import SamplingParams
from cpumoe.engine.config import EngineConfig
from cpumoe.server import create_app
from cpumoe.synthetic.checkpoint import make_checkpoint, tiny_overrides
from tests.server.serving import running_server

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("qwen3-30b-a3b", tmp_path_factory.mktemp("ckpt"), layers=2, vocab=400,
                           dtype=torch.float32, overrides=tiny_overrides("qwen3-30b-a3b"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = AsyncEngine.from_path(checkpoint, config=EngineConfig(num_blocks=64, max_model_len=256),
                                   model_name=MODEL)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    with running_server(create_app(engine, model_name=MODEL)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as c:
            yield c


def test_greedy_completion_matches_the_offline_engine(client, checkpoint):
    prompt = "Mixture of experts on CPUs"
    offline = LLMEngine(checkpoint, config=EngineConfig(num_blocks=64, max_model_len=256))
    expected = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == len(expected.new_token_ids)
    assert got.choices[0].text == expected.new_text


def test_concurrent_streaming_chats_all_finish(client, engine):
    results, errors = {}, []

    def one(i: int) -> None:
        try:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}],
                                                    max_tokens=8, temperature=0, stream=True)
            chunks = list(stream)
            results[i] = chunks[-1].choices[0].finish_reason if chunks[-1].choices else None
        except Exception as e:  # noqa: BLE001  (collected and reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 8 and all(r in ("stop", "length") for r in results.values()), results
    assert engine.stats()["kv_blocks_used"] == 0


def test_a_top_p_below_float32_neither_fails_its_request_nor_the_others(client):
    """top_p = 1e-300 rounds to 0 in float32: the sampler once removed every token, and the NaN failed the whole
    engine step, ending every stream in flight. It keeps the top token now: the odd request behaves as greedy."""
    results, errors = {}, []

    def one(i: int, top_p: float) -> None:
        try:
            r = client.completions.create(model=MODEL, prompt=f"x {i}", max_tokens=4, temperature=1, top_p=top_p,
                                          extra_body={"ignore_eos": True})
            results[i] = r.usage.completion_tokens
        except Exception as e:  # noqa: BLE001  (collected and reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i, 1e-300 if i == 0 else 0.9)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results == {i: 4 for i in range(4)}, results


def test_token_ids_the_tokenizer_knows_but_the_model_cannot_embed_are_a_400(client, engine, monkeypatch):
    """A tokenizer larger than the model's vocab_size: ids past the embedding are refused before anything runs."""
    monkeypatch.setattr(engine.engine, "vocab_size", len(engine.tokenizer) - 10)  # as if the tokenizer had 10 more
    with pytest.raises(openai.BadRequestError, match="prompt token ids must be in"):
        client.completions.create(model=MODEL, prompt=[1, len(engine.tokenizer) - 5], max_tokens=2)
    ok = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_a_checkpoint_without_a_tokenizer_is_refused_unless_token_ids_are_asked_for(checkpoint, tmp_path):
    import shutil

    import httpx

    from cpumoe.cli import main
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(checkpoint, bare)
    for f in bare.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            f.unlink()
    with pytest.raises(SystemExit, match="has no tokenizer"):
        main(["serve", str(bare), "--port", "8123"])
    prompt = [5, 17, 42, 99, 7]
    offline = LLMEngine(bare, config=EngineConfig(num_blocks=64, max_model_len=256))
    expected = offline.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    engine = AsyncEngine.from_path(bare, config=EngineConfig(num_blocks=64, max_model_len=256), model_name=MODEL,
                                   skip_tokenizer=True)
    try:
        with running_server(create_app(engine, model_name=MODEL)) as url, httpx.Client(base_url=url,
                                                                                        timeout=60) as http:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected.new_token_ids
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                ids = [i for line in s.iter_lines() if line.startswith("data: {")
                       for i in __import__("json").loads(line[6:])["choices"][0].get("token_ids") or []]
            assert ids == expected.new_token_ids
            for bad, param in [({"prompt": "text"}, "prompt"), ({"prompt": prompt, "stop": ["x"]}, "stop"),
                               ({"prompt": [400]}, "prompt")]:
                r = http.post("/v1/completions", json={**body, **bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    finally:
        engine.shutdown()


def test_speculative_serving_streams_the_same_text_and_counts_drafts(checkpoint):
    """`--speculative-config` through the server: a streamed greedy completion (several tokens in some chunks) is
    the text without speculation, and /metrics counts the drafts."""
    import httpx

    from cpumoe.engine.config import SpeculativeConfig

    prompt = "one two three one two three one two three one two"
    offline = LLMEngine(checkpoint, config=EngineConfig(num_blocks=64, max_model_len=256))
    expected = offline.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    engine = AsyncEngine.from_path(checkpoint, config=EngineConfig(num_blocks=64, max_model_len=256, speculative=spec),
                                   model_name=MODEL)
    try:
        with running_server(create_app(engine, model_name=MODEL)) as url:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as c:
                chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}))
            text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            assert text == expected.new_text
            metrics = httpx.get(f"{url}/metrics").text
    finally:
        engine.shutdown()
    stats = engine.stats()
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats
    assert f"cpumoe_spec_decode_num_accepted_tokens_total {float(stats['accepted_tokens'])}" in metrics
    assert f"cpumoe_spec_decode_num_draft_tokens_total {float(stats['draft_tokens'])}" in metrics
    # the packed weights as the load left them, and their bytes on huge pages (this machine's THP mode decides)
    from prometheus_client.parser import text_string_to_metric_families
    gauges = {s.name: s.value for family in text_string_to_metric_families(metrics) for s in family.samples}
    assert gauges["cpumoe_packed_weights_bytes"] == stats["packed_weights_bytes"] > 0
    assert 0 <= gauges["cpumoe_packed_weights_huge_page_bytes"] <= stats["packed_weights_bytes"]
