"""Speculative decoding: greedy output with n-gram or draft-model speculation is token for token the output without it,
for every architecture, under continuous batching, chunked budgets and preemption; rejection sampling keeps the
target's distribution (checked on the rule alone with exact probabilities, and end to end against non-speculative
sampling); the config is parsed and refused as vLLM's flag is; prompt lookup finds what it should.
"""
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cpumoe.engine.config import SpeculativeConfig  # noqa: E402
from cpumoe.engine.rejection_sampling import verify  # noqa: E402
from cpumoe.engine.speculative import NgramProposer  # noqa: E402
from tests.models import test_deepseek_v2, test_deepseek_v3, test_gpt_oss, test_qwen3_moe  # noqa: E402
from cpumoe.models import ARCHITECTURES  # noqa: E402
from tests.models.test_architectures import ARCHS  # noqa: E402
from tests.models.test_conformance import tiny_model as conformance_tiny_model  # noqa: E402

# repeated text gives prompt lookup something to find; the short prompt gives it nothing at first
PROMPTS = [[11, 87, 25, 71, 15, 92, 74, 62, 11, 87, 25, 71, 15, 92, 74], [5], [17, 99, 3, 17, 99, 3, 17, 99],
           list(range(30, 50))]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

TINY_MODELS = {
    "qwen3_moe": test_qwen3_moe.tiny_model,
    **{name: arch.tiny_model for name, arch in ARCHS.items()},
    "deepseek_v2": test_deepseek_v2.tiny_model,
    "deepseek_v3": test_deepseek_v3.tiny_model,
    "gpt_oss": test_gpt_oss.tiny_model,
}
# every other registered architecture: the conformance test's tiny model (dtype, then config overrides)
NOT_IN_MODELS_FILES = tuple(name for name in ARCHITECTURES if name not in TINY_MODELS)
TINY_MODELS |= {name: functools.partial(conformance_tiny_model, ARCHITECTURES[name]) for name in NOT_IN_MODELS_FILES}


def engine(path, speculative=None, **config):
    return LLMEngine(path, config=EngineConfig(**{"block_size": 4, "num_blocks": 96, **config},
                                               speculative=SpeculativeConfig.parse(speculative)))


@pytest.fixture(scope="module", params=list(TINY_MODELS), ids=list(TINY_MODELS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"spec_{request.param}")
    TINY_MODELS[request.param]().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec_qwen3")
    test_qwen3_moe.tiny_model().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3_other(tmp_path_factory):
    """A draft: the same architecture and vocabulary, other weights (it proposes what the target rejects)."""
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("spec_qwen3_other")
    model = test_qwen3_moe.tiny_model(num_hidden_layers=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * p.std().nan_to_num(0.0))
    model.save_pretrained(path)
    return path


def _tokens(outputs):
    return [o.new_token_ids for o in outputs]


def test_greedy_is_identical_for_every_architecture(checkpoint):
    plain = _tokens(engine(checkpoint).generate(PROMPTS, GREEDY))
    for spec in (dict(method="ngram", num_speculative_tokens=3),
                 dict(method="draft", model=str(checkpoint), num_speculative_tokens=2)):
        e = engine(checkpoint, spec)
        assert _tokens(e.generate(PROMPTS, GREEDY)) == plain, spec["method"]
        stats = e.stats()
        assert stats["verify_steps"] > 0 and stats["accepted_tokens"] > 0, (spec["method"], stats)
        assert stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("config", [dict(max_num_batched_tokens=3), dict(num_blocks=14), dict(max_num_seqs=2)],
                         ids=["budget-3", "preempting-cache", "two-seqs"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_is_identical_under_batching_limits(qwen3, qwen3_other, config, method):
    """Drafts cut by the token budget, dropped when the cache is full, sequences preempted and recomputed."""
    plain = _tokens(engine(qwen3, **config).generate(PROMPTS, GREEDY))
    spec = (dict(method="ngram", num_speculative_tokens=5) if method == "ngram"
            else dict(method="draft", model=str(qwen3_other), num_speculative_tokens=3))
    e = engine(qwen3, spec, **config)
    assert _tokens(e.generate(PROMPTS, GREEDY)) == plain
    assert e.stats()["verify_steps"] > 0


def test_accepted_drafts_end_at_stop_tokens_and_max_tokens(qwen3):
    """A step that accepts several drafts stops at the first stop token and never passes max_tokens."""
    plain = engine(qwen3).generate([PROMPTS[0]], GREEDY)[0].new_token_ids
    stop = plain[9]
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop])
    want = plain[:plain.index(stop) + 1]
    for k in (1, 4, 8):
        got = engine(qwen3, dict(method="ngram", num_speculative_tokens=k)).generate([PROMPTS[0]], params)[0]
        assert got.new_token_ids == want and got.finish_reason == "stop", k
        short = engine(qwen3, dict(method="ngram", num_speculative_tokens=k)).generate(
            [PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
        assert short.new_token_ids == plain[:5] and short.finish_reason == "length", k


def test_drafts_never_pass_max_model_len(qwen3):
    e = engine(qwen3, dict(method="ngram", num_speculative_tokens=8), max_model_len=20)
    out = e.generate([PROMPTS[0]], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.completion_tokens == 20 - len(PROMPTS[0]) and out.finish_reason == "length"


# ---- the rule alone, on exact probabilities -------------------------------------------------------------------

def _total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


@pytest.mark.parametrize("draft", ["point-mass", "sampled-q"])
def test_rejection_sampling_keeps_the_target_distribution(draft):
    """Whatever is drafted, the first token follows p_1, and after an accepted first draft the second follows p_2."""
    V, trials = 6, 12000
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 1.5, -0.5, 1.0, 0.0, 0.2],
                           [0.0, 0.0, 1.0, 0.0, 2.0, 0.0]])                                     # [k + 1, V]
    p = logits.softmax(dim=-1)
    q_dist = torch.tensor([[0.1, 0.1, 0.5, 0.1, 0.1, 0.1], [0.3, 0.1, 0.1, 0.3, 0.1, 0.1]])  # the draft's, [k, V]
    params = SamplingParams(temperature=1.0)
    first, second = torch.zeros(V), torch.zeros(V)
    accepted_first = 0
    for _ in range(trials):
        if draft == "point-mass":
            drafts, q = [0, 3], None
        else:
            drafts = [int(torch.multinomial(q_dist[i], 1, generator=generator)) for i in range(2)]
            q = q_dist
        out = verify(logits, [drafts], [q], [params], [generator])[0]
        assert 1 <= len(out) <= 3 and out[:-1] == drafts[:len(out) - 1]
        first[out[0]] += 1
        if len(out) > 1:
            accepted_first += 1
            second[out[1]] += 1
    assert _total_variation(first, p[0]) < 0.02, (first / trials, p[0])
    assert _total_variation(second, p[1]) < 0.04, (second / second.sum(), p[1])
    assert accepted_first > trials * 0.2  # the test saw accepted drafts


def test_greedy_verification_accepts_the_argmax_prefix():
    logits = torch.zeros(4, 5)
    logits[0, 3] = logits[1, 1] = logits[2, 4] = logits[3, 0] = 1.0
    greedy = SamplingParams(temperature=0.0)
    assert verify(logits, [[3, 1, 2]], [None], [greedy], [None]) == [[3, 1, 4]]
    assert verify(logits, [[0, 1, 4]], [None], [greedy], [None]) == [[3]]
    assert verify(logits, [[3, 1, 4]], [None], [greedy], [None]) == [[3, 1, 4, 0]]
    nan = logits.clone()
    nan[1, 2] = float("nan")
    assert verify(nan, [[3, 1, 4]], [None], [greedy], [None]) == [[3, -1]]


# ---- end to end, against sampling without speculation ------------------------------------------------------------

def _chi_square(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Two-sample chi-square statistic over the cells either sample saw, and its degrees of freedom."""
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    ka, kb = (b.sum() / a.sum()).sqrt(), (a.sum() / b.sum()).sqrt()
    return (((ka * a - kb * b) ** 2) / (a + b)).sum().item(), int(keep.sum()) - 1


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_output_matches_sampling_without_speculation(qwen3, qwen3_other, method):
    """The 2nd-4th tokens (the ones verification produces) of 480 seeded samples, with and without speculation:
    a two-sample chi-square test per position. A rule that kept every draft fails it by a wide margin."""
    n, positions = 480, (1, 2, 3)
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=6, seed=s, ignore_eos=True) for s in range(n)]
    prompt = PROMPTS[2]
    spec = (dict(method="ngram", num_speculative_tokens=3) if method == "ngram"
            else dict(method="draft", model=str(qwen3_other), num_speculative_tokens=3))
    runs = {}
    for name, e in (("plain", engine(qwen3, max_num_seqs=96, num_blocks=1024)),
                    ("spec", engine(qwen3, spec, max_num_seqs=96, num_blocks=1024))):
        runs[name] = _tokens(e.generate([prompt] * n, params))
        if name == "spec":
            stats = e.stats()
            assert stats["accepted_tokens"] > 0 and stats["accepted_tokens"] < stats["draft_tokens"], stats
    vocab = 128
    for pos in positions:
        counts = [torch.bincount(torch.tensor([t[pos] for t in runs[name]]), minlength=vocab).float()
                  for name in ("plain", "spec")]
        stat, dof = _chi_square(*counts)
        # 99.99th percentile of chi-square: about dof + 3.7 sqrt(2 dof) + 10 for the dof seen here (5-30)
        assert stat < dof + 3.7 * (2 * dof) ** 0.5 + 10, (pos, stat, dof)


# ---- config and prompt lookup ------------------------------------------------------------------------------------

def test_config_parses_vllm_json():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 3, 1)
    c = SpeculativeConfig.parse({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2})
    assert (c.method, c.model) == ("draft", "/m")
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2}).method == "draft"
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("text,message", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "must be one of ngram, draft"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "num_speculative_tokens must be a positive integer"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown key(s) typo"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4}', "prompt_lookup_min 4 is above"),
    ('{"method": "draft", "num_speculative_tokens": 2}', "needs a 'model'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}', "needs a 'model'"),
    ('{"method": "ngram",', "not valid JSON"),
    ('[1, 2]', "must be a JSON object"),
])
def test_bad_configs_are_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.parse(text)


def test_draft_with_another_vocabulary_is_refused(qwen3, tmp_path):
    test_qwen3_moe.tiny_model(vocab_size=100).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="100 token embeddings, the target 128"):
        engine(qwen3, dict(method="draft", model=str(tmp_path), num_speculative_tokens=2))


@pytest.mark.parametrize("tokens,k,want", [
    ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),                 # the 3-gram 1 2 3 was followed by 9
    ([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 3, [8, 1, 2]),  # the latest occurrence wins
    ([5, 6, 7, 4, 7], 2, [4, 7]),                       # no 3- or 2-gram repeats: the 1-gram 7 does
    ([1, 2, 3, 4], 2, []),                              # nothing repeats
    ([7], 2, []),
    ([4, 4, 4, 4], 5, [4]),                             # one token followed the only earlier match
    ([4, 4, 4, 4, 4, 4, 4], 3, [4, 4, 4]),              # in a loop, the match that k tokens follow
    ([1, 2, 9, 9, 1, 2, 8, 1, 2], 4, [9, 9, 1, 2]),     # the latest match (-> 8 1 2) is too close to the end
])
def test_prompt_lookup(tokens, k, want):
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=k))
    assert proposer.propose_one(tokens, k) == want


def test_prompt_lookup_min_limits_the_match():
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=2))
    assert proposer.propose_one([5, 6, 7, 4, 7], 2) == []


# ---- the command line --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from cpumoe.synthetic import make_checkpoint, tiny_overrides
    return make_checkpoint("qwen3-30b-a3b", tmp_path_factory.mktemp("spec_synth"), layers=2, vocab=300,
                           dtype=torch.float32, overrides=tiny_overrides("qwen3-30b-a3b"))


def test_generate_cli_with_speculation_prints_the_same_text(synthetic, capsys):
    from cpumoe.cli import main
    args = ["generate", str(synthetic), "--prompt", "a b c a b c a b c", "--max-tokens", "16"]
    assert main(args) == 0
    plain = capsys.readouterr().out.splitlines()[0]
    assert main(args + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == plain and out[-1].startswith("[speculative: ") and "drafts accepted" in out[-1]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_bad_speculative_config_is_a_usage_error(synthetic, capsys, command):
    from cpumoe.cli import main
    args = [command, str(synthetic)] + (["--prompt", "x"] if command == "generate" else [])
    with pytest.raises(SystemExit) as e:
        main(args + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'])
    assert e.value.code == 2
    assert "num_speculative_tokens must be a positive integer" in capsys.readouterr().err


def test_bench_model_speculative_report(synthetic, capsys, tmp_path):
    """The report: a no-speculation row and one per config and k, greedy tokens equal, acceptance on a repeated
    prompt, the experts a verification step reads (more than a plain step's), a bound and a speed-up."""
    import json

    from cpumoe.cli import main
    out = tmp_path / "spec.json"
    assert main(["bench", "model", str(synthetic), "--batch", "1", "--input-len", "64", "--output-len", "12",
                 "--quick", "--prompt", "repeated", "--speculative-k", "2,4", "--json", str(out),
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 1}',
                 "--speculative-config", json.dumps({"method": "draft", "model": str(synthetic),
                                                     "num_speculative_tokens": 1})]) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["method"], r["k"]) for r in rows] == [("none", 0), ("ngram", 2), ("ngram", 4), ("draft", 2),
                                                      ("draft", 4)]
    assert all(r["same_prefix"] == 1.0 for r in rows)  # float32
    base = rows[0]
    assert base["tokens_per_step"] == 1.0 and base["speedup"] == 1.0
    for r in rows[1:]:
        assert r["acceptance"] >= 0 and r["tokens_per_step"] >= 1, r   # drafts were verified
        assert r["experts_per_layer"] >= base["experts_per_layer"], r
        assert 0 < r["bound"] and r["speedup"] > 0
        assert r["uniform_experts_per_layer"] > base["uniform_experts_per_layer"] and r["uniform_bound"] > 0
    for r in (r for r in rows if r["method"] == "draft"):  # the draft is the target itself: it is always right
        assert r["acceptance"] > 0.9 and r["tokens_per_step"] > 2, r
        assert r["experts_per_layer"] > base["experts_per_layer"], r
    printed = capsys.readouterr().out
    assert "ngram" in printed and "draft" in printed and "results written" in printed
