"""Prefix caching: a prompt that starts with blocks another sequence computed shares them (reference counted, never
written), outputs are those without caching, and every block comes back; the block manager's keys, matches and
evictions on their own.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cpumoe.engine.kv_cache import BlockManager  # noqa: E402
from tests.engine.fake_sequences import Seq, computed  # noqa: E402
from tests.models import test_qwen3_moe  # noqa: E402

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SHARED = list(range(40, 58))                      # 18 tokens: four full blocks of 4, and two more


def test_match_shares_full_blocks_and_leaves_the_last_token():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = Seq(list(range(12)))                       # three full blocks
    computed(bm, a)
    b = Seq(list(range(12)))
    assert bm.match_prefix(b) == 8                 # not the third block: its last token must be computed
    assert b.block_table == a.block_table[:2] and [bm.ref_counts[x] for x in b.block_table] == [2, 2]
    c = Seq(list(range(8)) + [99, 98, 97, 96, 95])
    assert bm.match_prefix(c) == 8 and c.block_table == a.block_table[:2]
    d = Seq([0, 1, 2, 7, 4, 5, 6, 7, 8])           # differs in the first block: nothing
    assert bm.match_prefix(d) == 0 and d.block_table == []


def test_freed_blocks_stay_cached_until_reused_last_blocks_first():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a = Seq(list(range(12)))
    computed(bm, a)
    first, second, third = a.block_table
    bm.free(a)
    assert bm.num_used == 0 and [bm.ref_counts[x] for x in (first, second, third)] == [0, 0, 0]
    again = Seq(list(range(13)))
    assert bm.match_prefix(again) == 12 and again.block_table == [first, second, third] and bm.num_used == 3
    bm2 = BlockManager(4, 4, enable_prefix_caching=True)
    a = Seq(list(range(12)))
    computed(bm2, a)
    first, second, third = a.block_table
    bm2.free(a)
    other = Seq([100] * 8)
    bm2.allocate(other, 8)                         # the never-used block, then the one freed first: a's last
    assert third in other.block_table and first not in other.block_table
    assert bm2.match_prefix(Seq(list(range(12)))) == 8   # its first two blocks are still there


def test_without_prefix_caching_nothing_is_shared():
    bm = BlockManager(8, 4)
    a = Seq(list(range(12)))
    computed(bm, a)
    assert bm.cached == {} and bm.match_prefix(Seq(list(range(12)))) == 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix_qwen3")
    test_qwen3_moe.tiny_model().save_pretrained(path)
    return path


def engine(path, **config):
    return LLMEngine(path, config=EngineConfig(**{"block_size": 4, "num_blocks": 64, **config}))


PROMPTS = [SHARED + [1, 2, 3], SHARED + [7], SHARED[:9], SHARED + [1, 2, 3]]


@pytest.mark.parametrize("config", [{}, dict(max_num_batched_tokens=5), dict(num_blocks=12)],
                         ids=["whole-prompts", "chunks-of-5", "preempting-cache"])
def test_outputs_equal_those_without_caching(checkpoint, config):
    plain = engine(checkpoint, enable_prefix_caching=False, **config)
    want = [o.new_token_ids for o in plain.generate(PROMPTS, GREEDY)]
    e = engine(checkpoint, **config)
    assert [o.new_token_ids for o in e.generate(PROMPTS, GREEDY)] == want   # in one batch
    for prompt, tokens in zip(PROMPTS, want):                                # one after another: hits
        assert e.generate([prompt], GREEDY)[0].new_token_ids == tokens
    stats = e.stats()
    assert stats["prefix_cache_hits"] >= 4 * 4 * len(PROMPTS), stats
    assert stats["kv_blocks_used"] == 0


def test_a_repeated_conversation_reuses_its_generated_tokens(checkpoint):
    """A follow-up prompt that repeats an earlier prompt and its answer finds both in the cache."""
    e = engine(checkpoint)
    first = e.generate([SHARED], GREEDY)[0].new_token_ids
    before = e.stats()["prefix_cache_hits"]
    follow_up = SHARED + first + [5, 6]
    got = e.generate([follow_up], GREEDY)[0].new_token_ids
    assert e.stats()["prefix_cache_hits"] - before == (len(SHARED) + len(first) - 1) // 4 * 4
    assert got == engine(checkpoint, enable_prefix_caching=False).generate([follow_up], GREEDY)[0].new_token_ids


def test_sampled_requests_with_a_seed_draw_the_same_with_and_without_caching(checkpoint):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    plain = engine(checkpoint, enable_prefix_caching=False).generate([PROMPTS[0]] * 2, params)
    e = engine(checkpoint)
    e.generate([PROMPTS[0]], GREEDY)
    assert [o.new_token_ids for o in e.generate([PROMPTS[0]] * 2, params)] == [o.new_token_ids for o in plain]


def test_serve_flag_turns_it_off(checkpoint):
    from cpumoe.cli import build_parser
    args = build_parser().parse_args(["serve", str(checkpoint), "--no-enable-prefix-caching"])
    assert args.enable_prefix_caching is False
    assert build_parser().parse_args(["serve", str(checkpoint)]).enable_prefix_caching is True


def test_cached_blocks_are_never_written(checkpoint):
    """The K/V of shared blocks are bit for bit what the first sequence wrote, after others reused them."""
    e = engine(checkpoint)
    e.generate([PROMPTS[0]], GREEDY)
    bm = e.scheduler.block_manager
    shared = sorted(bm.cached.values())
    before = [(k[shared].clone(), v[shared].clone()) for k, v in e.kv_cache.layers]
    e.generate(PROMPTS, GREEDY)
    assert all(b in bm.hash_of for b in shared[:4])
    for (k, v), (k0, v0) in zip(e.kv_cache.layers, before):
        assert torch.equal(k[shared], k0) and torch.equal(v[shared], v0)
