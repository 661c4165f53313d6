"""The Scheduler with fake sequences and no model: the token budget of a step (running sequences first, oldest
first, then waiting ones in arrival order; prompts chunked), max_num_seqs, preemption of the newest running sequence
when blocks run out (its blocks freed, back at the front of the waiting queue, recomputed from scratch or from its
cached prefix), drafts cut to the budget, and finish()."""
import random

import pytest

from cpumoe.engine.api import SamplingParams
from cpumoe.engine.config import EngineConfig
from cpumoe.engine.scheduler import Scheduler, Sequence, SequenceStatus

TOKEN = 7   # what every fake step samples


def scheduler(num_blocks=64, *, budget=512, max_num_seqs=64, prefix_caching=False) -> Scheduler:
    return Scheduler(EngineConfig(block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  enable_prefix_caching=prefix_caching), num_blocks)


def seq(rid: str, prompt_len: int, *, first: int | None = None, max_tokens: int = 16) -> Sequence:
    """A prompt of distinct tokens (no two fake sequences share a prefix unless `first` makes them)."""
    start = first if first is not None else 1000 * (ord(rid[0]) - ord("a") + 1)
    return Sequence(rid, list(range(start, start + prompt_len)), prompt_len, SamplingParams(max_tokens=max_tokens))


def step(s: Scheduler) -> list[tuple[str, int]]:
    """schedule() and what the engine does after the model ran: computed tokens advance by the step's tokens, a
    sequence that reached its last token gets one more. Returns [(request_id, num_new_tokens)]."""
    batch = s.schedule()
    assert batch.num_tokens <= s.config.max_num_batched_tokens
    for i, (q, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        assert q.status is SequenceStatus.RUNNING and n >= 1
        # the blocks cover exactly the tokens computed after this step
        assert len(q.block_table) == -(-(q.num_computed_tokens + n) // 4)
        samples = batch.samples(i)
        q.num_computed_tokens += n
        if samples:
            q.token_ids.append(TOKEN)
        s.computed(q)
    step.last = batch
    return [(q.request_id, n) for q, n in zip(batch.seqs, batch.num_new_tokens)]


def ids(seqs) -> list[str]:
    return [q.request_id for q in seqs]


# ---- the token budget and chunked prefill ---------------------------------------------------------------------

def test_a_prompt_longer_than_the_budget_is_chunked_with_exact_progress():
    s = scheduler(budget=5)
    a = seq("a", 12)
    s.add(a)
    progress = []
    for _ in range(5):
        progress.append((step(s), a.num_computed_tokens, a.num_tokens, len(a.block_table)))
    assert progress == [([("a", 5)], 5, 12, 2),         # chunks: no token sampled
                        ([("a", 5)], 10, 12, 3),
                        ([("a", 2)], 12, 13, 3),        # the last chunk samples
                        ([("a", 1)], 13, 14, 4),        # decodes
                        ([("a", 1)], 14, 15, 4)]


def test_samples_only_in_the_step_that_computes_the_last_token():
    s = scheduler(budget=4)
    a = seq("a", 6)
    s.add(a)
    batch = s.schedule()
    assert batch.num_new_tokens == [4] and not batch.samples(0)
    a.num_computed_tokens += 4
    batch = s.schedule()
    assert batch.num_new_tokens == [2] and batch.samples(0)


def test_running_sequences_come_first_and_the_waiting_get_what_is_left():
    s = scheduler(budget=6)
    a, b = seq("a", 10), seq("b", 3)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 6)]                      # the budget is spent: b waits
    assert ids(s.waiting) == ["b"] and b.num_computed_tokens == 0
    assert step(s) == [("a", 4), ("b", 2)]            # a's last chunk, then b's first with what is left
    assert step(s) == [("a", 1), ("b", 1)]            # a decodes, b's last prompt token
    assert step(s) == [("a", 1), ("b", 1)]
    assert ids(s.running) == ["a", "b"]


def test_decodes_of_older_sequences_come_before_a_newer_prefill():
    s = scheduler(budget=8)
    a = seq("a", 3)
    s.add(a)
    assert step(s) == [("a", 3)]
    s.add(seq("b", 10))
    s.add(seq("c", 2))
    assert step(s) == [("a", 1), ("b", 7)]            # c is not admitted: no budget left
    assert step(s) == [("a", 1), ("b", 3), ("c", 2)]  # running oldest first, then c admitted
    assert step(s) == [("a", 1), ("b", 1), ("c", 1)]


def test_several_waiting_prompts_fill_one_step_in_arrival_order():
    s = scheduler(budget=10)
    for rid, n in (("a", 3), ("b", 4), ("c", 5), ("d", 1)):
        s.add(seq(rid, n))
    assert step(s) == [("a", 3), ("b", 4), ("c", 3)]   # c chunked to the budget; d waits
    assert ids(s.waiting) == ["d"]
    assert step(s) == [("a", 1), ("b", 1), ("c", 2), ("d", 1)]


def test_a_budget_of_one_token_computes_one_token_a_step():
    s = scheduler(budget=1)
    a, b = seq("a", 3), seq("b", 2)
    s.add(a)
    s.add(b)
    got = [step(s) for _ in range(6)]
    # a's whole prompt, then a decodes on forever: b never fits, as the policy says (running first)
    assert got == [[("a", 1)]] * 6 and ids(s.waiting) == ["b"] and a.num_computed_tokens == 6


def test_drafts_follow_a_decode_as_far_as_the_budget_and_blocks_allow():
    s = scheduler(num_blocks=3, budget=3)
    a = seq("a", 3)
    s.add(a)
    step(s)                                           # 4 tokens, 3 computed: a decodes next
    a.spec_token_ids = [1, 2, 3, 4]
    batch = s.schedule()
    assert batch.num_new_tokens == [3] and batch.drafts == [[1, 2]] and batch.samples(0)
    assert a.spec_token_ids == [1, 2] and len(a.block_table) == 2
    s2 = scheduler(num_blocks=1, budget=8)
    b = seq("b", 2)
    s2.add(b)
    step(s2)                                          # 3 tokens in one block; 3 drafts would need a second
    b.spec_token_ids = [1, 2, 3]
    batch = s2.schedule()
    assert batch.num_new_tokens == [1] and batch.drafts == [[]] and b.spec_token_ids == []


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-caching", "prefix-caching"])
def test_a_random_workload_keeps_every_limit(prefix_caching):
    """Whatever arrives: at most max_num_batched_tokens a step, at most max_num_seqs running, every block in use
    referenced exactly as often as the running sequences' tables hold it, waiting sequences hold nothing, a finished
    sequence is never scheduled, and every block comes back."""
    rng = random.Random(0)
    s = scheduler(num_blocks=10, budget=9, max_num_seqs=3, prefix_caching=prefix_caching)
    # with prefix caching, prompts start with one of two shared runs of tokens
    pending = [seq(chr(ord("a") + i), rng.randint(1, 20), first=100 * (i % 2 if prefix_caching else i),
                   max_tokens=rng.randint(1, 8)) for i in range(12)]
    finished, steps = set(), 0
    bm = s.block_manager
    while pending or s.has_unfinished():
        if pending and rng.random() < 0.5:
            s.add(pending.pop(0))
        got = step(s)
        steps += 1
        assert sum(n for _, n in got) <= 9
        assert not finished & {rid for rid, _ in got}
        assert len(s.running) <= 3
        refs = [0] * bm.num_blocks
        for q in s.running:
            for b in q.block_table:
                refs[b] += 1
        assert bm.ref_counts == refs and bm.num_used == sum(r > 0 for r in refs)
        assert all(not q.block_table and q.num_computed_tokens == 0 for q in s.waiting)
        for q in list(s.running):
            if q.num_completion_tokens >= q.params.max_tokens:
                s.finish(q, "length")
                finished.add(q.request_id)
        assert steps < 500
    assert len(finished) == 12 and bm.num_used == 0
    assert s.num_preemptions > 0                      # the cache was small enough to need it
    assert (bm.prefix_hits > 0) == prefix_caching


# ---- max_num_seqs -----------------------------------------------------------------------------------------------

def test_max_num_seqs_caps_the_running_and_the_next_is_admitted_when_one_finishes():
    s = scheduler(max_num_seqs=2)
    a, b, c = seq("a", 2), seq("b", 2), seq("c", 2)
    for q in (a, b, c):
        s.add(q)
    assert step(s) == [("a", 2), ("b", 2)]
    assert step(s) == [("a", 1), ("b", 1)]            # budget and blocks to spare: c still waits
    assert ids(s.running) == ["a", "b"] and ids(s.waiting) == ["c"] and c.status is SequenceStatus.WAITING
    s.finish(a, "stop")
    assert step(s) == [("b", 1), ("c", 2)]
    assert ids(s.running) == ["b", "c"] and not s.waiting


# ---- preemption ---------------------------------------------------------------------------------------------

def test_the_newest_running_sequence_is_preempted_when_an_older_one_needs_a_block():
    s = scheduler(num_blocks=4)
    a, b, c = seq("a", 4), seq("b", 4), seq("c", 8)
    for q in (a, b, c):
        s.add(q)
    assert step(s) == [("a", 4), ("b", 4), ("c", 8)]  # all four blocks in use; each has one token more
    d = seq("d", 1)
    s.add(d)
    assert s.block_manager.num_free == 0
    assert step(s) == [("a", 1), ("b", 1)]            # a needs a second block: c, the newest, makes room
    assert step.last.preempted == [c] and s.num_preemptions == 1
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert c.token_ids == list(range(3000, 3008)) + [TOKEN]   # its sampled token is kept, to recompute
    assert ids(s.running) == ["a", "b"] and ids(s.waiting) == ["c", "d"]   # the front of the queue
    assert s.block_manager.num_used == 4 and len(a.block_table) == len(b.block_table) == 2
    assert step(s) == [("a", 1), ("b", 1)]            # no room for c (9 tokens, 3 blocks): nobody else is admitted
    assert ids(s.waiting) == ["c", "d"]
    s.finish(a, "stop")
    s.finish(b, "stop")
    assert step(s) == [("c", 9), ("d", 1)]            # c from scratch: its prompt and its sampled token
    assert c.num_computed_tokens == 9 and c.num_tokens == 10   # and it sampled again


def test_preempting_several_in_one_step_keeps_them_in_arrival_order():
    s = scheduler(num_blocks=3)
    a, b, c = seq("a", 4), seq("b", 4), seq("c", 4)
    for q in (a, b, c):
        s.add(q)
    step(s)
    assert step(s) == [("a", 1)]                      # c goes for a's block; b, the newest left, for its own
    assert step.last.preempted == [c, b] and s.num_preemptions == 2
    assert ids(s.running) == ["a"] and ids(s.waiting) == ["b", "c"]
    assert s.block_manager.num_used == 2 and b.block_table == c.block_table == []


def test_a_sequence_that_is_itself_the_newest_is_preempted_and_nothing_is_admitted():
    s = scheduler(num_blocks=3, budget=10)
    a, b, c = seq("a", 6), seq("b", 8), seq("c", 1)
    for q in (a, b, c):
        s.add(q)
    assert step(s) == [("a", 6), ("b", 4)]            # b's first chunk needs only one block
    assert s.block_manager.num_free == 0
    assert step(s) == [("a", 1)]                      # b's second chunk finds no block: b is the newest
    assert step.last.preempted == [b]
    assert ids(s.waiting) == ["b", "c"] and b.num_computed_tokens == 0 and s.block_manager.num_free == 1


def test_nothing_is_admitted_in_a_step_that_preempted_even_what_would_fit():
    s = scheduler(num_blocks=5, budget=4)
    a, b, c = seq("a", 1), seq("b", 1), seq("c", 12)
    for q in (a, b, c):
        s.add(q)
    got = [step(s) for _ in range(4)]                 # a and b decode, c's prompt in chunks of 2
    assert got == [[("a", 1), ("b", 1), ("c", 2)]] * 4
    assert [len(q.block_table) for q in (a, b, c)] == [1, 1, 2] and s.block_manager.num_free == 1
    assert step(s) == [("a", 1), ("b", 1)]            # a takes the free block, b one of c's two
    assert step.last.preempted == [c] and ids(s.waiting) == ["c"] and s.block_manager.num_free == 1
    # c's next chunk (2 tokens, 1 block) would fit in what is left: it waits for the next step all the same
    assert step(s) == [("a", 1), ("b", 1), ("c", 2)]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["recompute-all", "from-cached-prefix"])
def test_a_preempted_sequence_is_recomputed_from_scratch_or_its_cached_prefix(prefix_caching):
    s = scheduler(num_blocks=4, prefix_caching=prefix_caching)
    a, c = seq("a", 4), seq("c", 9)
    s.add(a)
    s.add(c)
    assert step(s) == [("a", 4), ("c", 9)]            # a: 5 tokens, c: 10 tokens; no block free
    c_blocks = list(c.block_table)
    assert step(s) == [("a", 1)] and step.last.preempted == [c]
    assert step(s) == [("a", 1)]                      # c, 3 blocks, does not fit in the 0 free ones
    assert c.block_table == [] and c.num_computed_tokens == 0
    s.finish(a, "length")
    batch = s.schedule()
    bm = s.block_manager
    if prefix_caching:                                # its first two blocks (8 tokens) are still cached
        assert batch.num_new_tokens == [2] and c.num_computed_tokens == 8 and c.block_table[:2] == c_blocks[:2]
        assert (bm.prefix_queries, bm.prefix_hits) == (4 + 9 + 10, 8)   # each admission counted once
    else:
        assert batch.num_new_tokens == [10] and c.num_computed_tokens == 0
        assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)
    assert batch.seqs == [c] and batch.samples(0) and len(c.block_table) == 3


def test_a_waiting_prompt_that_does_not_fit_blocks_those_behind_it():
    s = scheduler(num_blocks=3)
    a, b, c = seq("a", 6), seq("b", 8), seq("c", 3)
    for q in (a, b, c):
        s.add(q)
    assert step(s) == [("a", 6)]                      # b needs two blocks, one is free; c would fit but waits
    assert ids(s.waiting) == ["b", "c"] and s.block_manager.num_free == 1
    s.finish(a, "stop")
    assert step(s) == [("b", 8), ("c", 3)]


def test_a_failed_admission_gives_back_the_cached_blocks_it_matched():
    s = scheduler(num_blocks=4, prefix_caching=True)
    a = seq("a", 8)
    s.add(a)
    step(s)                                           # blocks 0 and 1, both full and cached
    s.finish(a, "length")
    bm = s.block_manager
    x = seq("x", 0)
    bm.allocate(x, 8)                                 # the two never-used blocks: none free
    b = seq("b", 10, first=1000)                      # a's prompt, then tokens of its own
    s.add(b)
    assert step(s) == []                              # its match (2 blocks) leaves it one short
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.block_hashes == []
    assert bm.num_free == 2 and bm.ref_counts[:2] == [0, 0] and len(bm.cached) == 2
    assert (bm.prefix_queries, bm.prefix_hits) == (8, 0)   # b's lookup is counted once it is admitted
    bm.free(x)
    assert step(s) == [("b", 2)]
    assert b.block_table[:2] == [0, 1] and (bm.prefix_queries, bm.prefix_hits) == (18, 8)


# ---- finish -----------------------------------------------------------------------------------------------------

def test_finish_frees_blocks_and_a_finished_sequence_is_never_scheduled_again():
    s = scheduler(num_blocks=8, budget=6)
    a, b, c = seq("a", 5), seq("b", 4), seq("c", 3)
    for q in (a, b, c):
        s.add(q)
    assert step(s) == [("a", 5), ("b", 1)]
    assert s.block_manager.num_used == 3
    s.finish(a, "stop")
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "stop" and a.block_table == []
    assert s.block_manager.num_used == 1 and a not in s.running
    s.finish(c, "abort")                              # still waiting: leaves the queue
    assert c.status is SequenceStatus.FINISHED and not s.waiting and c.block_table == []
    for _ in range(4):
        assert [rid for rid, _ in step(s)] == ["b"]
    s.finish(b, "length")
    assert s.block_manager.num_used == 0 and not s.has_unfinished()
    assert step(s) == [] and s.schedule().seqs == []


def test_finishing_twice_changes_nothing_more():
    s = scheduler(num_blocks=4)
    a, b = seq("a", 4), seq("b", 4)
    s.add(a)
    s.add(b)
    step(s)
    s.finish(a, "stop")
    free = list(s.block_manager.free_blocks)
    s.finish(a, "stop")
    assert list(s.block_manager.free_blocks) == free and ids(s.running) == ["b"] and b.block_table != []


def test_a_batch_counts_its_decodes_apart_from_prompt_chunks():
    s = scheduler(budget=8)
    s.add(seq("a", 5))
    step(s)                                   # a's whole prompt: a prefill, no decode
    s.add(seq("b", 10))
    batch = s.schedule()                      # a decodes; b's first 7 prompt tokens ride beside it
    assert [(q.request_id, n) for q, n in zip(batch.seqs, batch.num_new_tokens)] == [("a", 1), ("b", 7)]
    assert (batch.num_decodes, batch.num_decode_tokens, batch.num_tokens) == (1, 1, 8)
