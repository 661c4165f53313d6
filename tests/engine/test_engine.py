"""The engine end to end on tiny checkpoints: greedy outputs through the paged KV cache equal transformers'
generate(do_sample=False), whatever the batching (chunked prefill with a tiny token budget, concurrent requests of
different lengths, preemption under a tiny KV cache); aborts free every block; finish reasons; the async front
end; `cpumoe generate`.
"""
import asyncio

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cpumoe.cli import main  # noqa: E402
from cpumoe.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tests.models.test_qwen3_moe import tiny_model  # noqa: E402

PROMPTS = [[111, 87, 25, 71, 115, 92, 74, 62, 46, 32, 88], [5], [17, 99, 3], list(range(30, 60, 1)),
           [7, 7, 7, 7, 7, 9]]
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    model = tiny_model()
    path = tmp_path_factory.mktemp("engine_fp32")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def reference(hf_pair):
    """transformers' greedy tokens for each prompt, alone: {prompt index: ids}."""
    model, _ = hf_pair
    ref = {}
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, min_new_tokens=12)
            ref[i] = out[0, len(p):].tolist()
    return ref


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from cpumoe.synthetic import make_checkpoint, tiny_overrides
    return make_checkpoint("qwen3-30b-a3b", tmp_path_factory.mktemp("engine_synth"), layers=2, vocab=300,
                           dtype=torch.float32, overrides=tiny_overrides("qwen3-30b-a3b"))


def engine(path, **config):
    return LLMEngine(path, config=EngineConfig(**{"block_size": 4, "num_blocks": 64, **config}))


@pytest.mark.parametrize("budget", [512, 5, 1], ids=["whole-prompt", "chunks-of-5", "chunks-of-1"])
def test_greedy_matches_transformers(hf_pair, reference, budget):
    e = engine(hf_pair[1], max_num_batched_tokens=budget)
    out = e.generate([PROMPTS[0]], SamplingParams(max_tokens=12, **GREEDY))[0]
    assert out.new_token_ids == reference[0], f"token budget {budget}"
    assert out.finish_reason == "length" and out.prompt_tokens == 11 and out.completion_tokens == 12


@pytest.mark.parametrize("budget", [512, 7], ids=["budget-512", "budget-7"])
def test_concurrent_requests_match_alone(hf_pair, reference, budget):
    e = engine(hf_pair[1], max_num_batched_tokens=budget)
    outs = e.generate(PROMPTS, SamplingParams(max_tokens=12, **GREEDY))
    for i, out in enumerate(outs):
        assert out.new_token_ids == reference[i], f"prompt {i} (length {len(PROMPTS[i])}) in a batch"


def test_requests_arriving_mid_generation(hf_pair, reference):
    e = engine(hf_pair[1], max_num_batched_tokens=6)
    got = {str(i): [] for i in range(len(PROMPTS))}
    e.add_request("0", PROMPTS[0], SamplingParams(max_tokens=12, **GREEDY))
    pending = list(range(1, len(PROMPTS)))
    while e.has_unfinished() or pending:
        if pending:
            i = pending.pop(0)
            e.add_request(str(i), PROMPTS[i], SamplingParams(max_tokens=12, **GREEDY))
        for out in e.step():
            got[out.request_id] += out.new_token_ids
    assert got == {str(i): reference[i] for i in range(len(PROMPTS))}


def test_preemption_gives_same_outputs(hf_pair, reference):
    # 12 blocks of 4 = 48 tokens; the five requests need 13 + 4 + 4 + 11 + 5 = 37 blocks in all
    e = engine(hf_pair[1], num_blocks=12, max_num_batched_tokens=16)
    outs = e.generate(PROMPTS, SamplingParams(max_tokens=12, **GREEDY))
    assert e.scheduler.num_preemptions > 0
    for i, out in enumerate(outs):
        assert out.new_token_ids == reference[i], f"prompt {i} after preemption"
    assert e.scheduler.block_manager.num_used == 0


def test_abort_frees_all_blocks(hf_pair):
    e = engine(hf_pair[1], max_num_batched_tokens=8)
    for i, p in enumerate(PROMPTS):
        e.add_request(str(i), p, SamplingParams(max_tokens=50, **GREEDY))
    for _ in range(4):
        e.step()
    bm = e.scheduler.block_manager
    used = bm.num_used
    assert used > 0 and e.abort("0") and bm.num_used < used
    assert not e.abort("0") and not e.abort("nope")
    for i in range(1, len(PROMPTS)):
        e.abort(str(i))
    assert bm.num_used == 0 and e.stats()["running"] == e.stats()["waiting"] == 0
    outs = e.step()
    assert sorted(o.request_id for o in outs) == [str(i) for i in range(len(PROMPTS))]
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    assert not e.has_unfinished()


def test_a_failing_request_fails_alone(synthetic):
    """One request's detokenizer raising, and another's logits turning NaN, end those two with finish_reason
    "error" and the reason; the third finishes as it would alone and every KV block comes back."""
    e = engine(synthetic)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = e.generate(["the same prompt"], params)[0]
    for rid, prompt in (("bad-detok", "one prompt"), ("bad-logits", "another prompt"), ("good", "the same prompt")):
        e.add_request(rid, e.encode(prompt), params)

    def broken_add(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    e.seqs["bad-detok"].detokenizer.add = broken_add
    run = e.runner.run

    def nan_for_one(batch):  # the second sampling row gets NaN logits, as a broken model would give
        tokens = run(batch)
        ids = [s.request_id for i, s in enumerate(batch.seqs) if batch.samples(i)]
        return [[-1] if rid == "bad-logits" else t for rid, t in zip(ids, tokens)]
    e.runner.run = nan_for_one
    finished, good_tokens = {}, []
    while e.has_unfinished():
        for out in e.step():
            if out.request_id == "good":
                good_tokens += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out
    assert good_tokens == alone.new_token_ids
    assert finished["bad-detok"].finish_reason == "error" and "detokenization failed" in finished["bad-detok"].error
    assert finished["bad-logits"].finish_reason == "error" and "sampling failed" in finished["bad-logits"].error
    assert finished["good"].finish_reason == "length" and finished["good"].error is None
    assert e.scheduler.block_manager.num_used == 0


def test_prompt_ids_outside_the_models_vocabulary_are_refused(synthetic):
    e = engine(synthetic)
    with pytest.raises(ValueError, match=r"must be in \[0, 300\)"):
        e.add_request("x", [1, 300], SamplingParams())
    with pytest.raises(ValueError, match="must be in"):
        e.add_request("y", [-1], SamplingParams())
    assert not e.has_unfinished()


def test_finish_reasons(hf_pair, reference):
    path = hf_pair[1]
    stop_at = reference[0][4]
    first = reference[0].index(stop_at)
    out = engine(path).generate([PROMPTS[0]], SamplingParams(max_tokens=12, stop_token_ids=[stop_at], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.new_token_ids == reference[0][:first + 1]
    out = engine(path, max_model_len=16).generate([PROMPTS[0]], SamplingParams(max_tokens=12, **GREEDY))[0]
    assert out.finish_reason == "length" and out.new_token_ids == reference[0][:5]   # 11 + 5 = max_model_len
    out = engine(path).generate([PROMPTS[0]], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert out.finish_reason == "length" and len(out.new_token_ids) == 3
    with pytest.raises(ValueError, match="max_model_len"):
        engine(path, max_model_len=11).add_request("x", PROMPTS[0], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine(path).add_request("x", [], SamplingParams())


def test_eos_and_stop_string(synthetic):
    e = engine(synthetic, num_blocks=32)
    prompt = e.encode("Return the list of")
    free = e.generate([prompt], SamplingParams(max_tokens=16, **GREEDY))[0]
    assert free.finish_reason == "length" and len(free.new_text) > 4
    # the engine's text is the tokenizer's decode of the tokens
    assert free.new_text == e.tokenizer.decode(free.new_token_ids, skip_special_tokens=True)
    stop = free.new_text[2:4]
    out = e.generate([prompt], SamplingParams(max_tokens=16, stop=[stop], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.new_text == free.new_text[:free.new_text.index(stop)]
    eos = e.tokenizer.eos_token_id
    assert eos in e.eos_token_ids
    e.eos_token_ids = {free.new_token_ids[3]}  # pretend the 4th token is eos: generation stops there
    out = e.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.new_token_ids == free.new_token_ids[:free.new_token_ids.index(
        free.new_token_ids[3]) + 1]
    assert e.scheduler.block_manager.num_used == 0


def test_seeded_sampling_is_reproducible(hf_pair):
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    a = engine(hf_pair[1]).generate([PROMPTS[0]], params)[0].new_token_ids
    b = engine(hf_pair[1], max_num_batched_tokens=4).generate([PROMPTS[0], PROMPTS[2]], params)[0].new_token_ids
    assert a == b


def test_async_engine_streams_and_cancels(hf_pair, reference):
    ae = AsyncEngine(engine(hf_pair[1], max_num_batched_tokens=8))
    seen = []
    ae.on_token.append(lambda rid, first, t: seen.append((rid, first)))

    async def collect(rid, i, n=12):
        ids = []
        async for out in ae.generate(rid, PROMPTS[i], SamplingParams(max_tokens=n, **GREEDY)):
            ids += out.new_token_ids
        return ids, out.finish_reason

    async def cancel_early():
        gen = ae.generate("cancel", PROMPTS[3], SamplingParams(max_tokens=200, **GREEDY))
        async for _ in gen:
            break
        await gen.aclose()

    async def main_():
        results = await asyncio.gather(collect("a", 0), collect("b", 2), cancel_early())
        for _ in range(100):  # the abort reaches the engine thread asynchronously
            if ae.stats()["kv_blocks_used"] == 0:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="empty"):
            async for _ in ae.generate("bad", [], SamplingParams()):
                pass
        return results

    try:
        (a, ra), (b, rb), _ = asyncio.run(main_())
    finally:
        ae.shutdown()
    assert a == reference[0] and b == reference[2] and ra == rb == "length"
    stats = ae.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0
    assert stats["kv_blocks_total"] == 64 and stats["tokens_processed"] > 0
    assert ("a", True) in seen and seen.count(("a", True)) == 1 and seen.count(("a", False)) == 11


def test_generate_cli(synthetic, capsys):
    assert main(["generate", str(synthetic), "--prompt", "Hello there", "--chat", "--max-tokens", "5",
                 "--kv-cache-gb", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "5 tokens" in out
    assert main(["generate", str(synthetic), "--prompt", "Hi", "--max-tokens", "3", "--temperature", "0.8",
                 "--top-p", "0.9", "--seed", "1", "--kv-cache-gb", "0.01"]) == 0
