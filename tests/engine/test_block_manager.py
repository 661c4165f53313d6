"""The BlockManager on its own, with fake sequences: blocks needed at block boundaries, allocate/free accounting,
can_allocate exactly when enough blocks are free, freeing twice, reference-counted shared prefix blocks and the order
in which cached free blocks are handed out again."""
import pytest

from cpumoe.engine.kv_cache import BlockManager
from tests.engine.fake_sequences import Seq, computed


@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed_at_block_boundaries(tokens, blocks):
    assert BlockManager(8, 4).blocks_needed(Seq(), tokens) == blocks


def test_blocks_needed_counts_only_blocks_beyond_the_table():
    bm = BlockManager(8, 4)
    s = Seq(block_table=[5])
    assert [bm.blocks_needed(s, n) for n in (1, 3, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]
    s = Seq(block_table=[5, 6, 7])
    assert bm.blocks_needed(s, 1) == 0 and bm.blocks_needed(s, 12) == 0 and bm.blocks_needed(s, 13) == 1


def test_allocate_grows_the_table_and_free_gives_every_block_back():
    bm = BlockManager(6, 4)
    assert (bm.num_free, bm.num_used) == (6, 0)
    a = Seq()
    bm.allocate(a, 5)
    assert a.block_table == [0, 1] and (bm.num_free, bm.num_used) == (4, 2)
    bm.allocate(a, 8)                               # still two blocks: nothing new
    assert a.block_table == [0, 1] and bm.num_used == 2
    bm.allocate(a, 3)                               # fewer tokens than it holds: nothing, nothing taken back
    assert a.block_table == [0, 1] and bm.num_used == 2
    bm.allocate(a, 9)                               # appended
    assert a.block_table == [0, 1, 2] and (bm.num_free, bm.num_used) == (3, 3)
    b = Seq()
    bm.allocate(b, 4)
    assert b.block_table == [3] and bm.num_used == 4
    assert [bm.ref_counts[x] for x in range(6)] == [1, 1, 1, 1, 0, 0]
    bm.free(a)
    assert a.block_table == [] and (bm.num_free, bm.num_used) == (5, 1)
    assert [bm.ref_counts[x] for x in range(6)] == [0, 0, 0, 1, 0, 0]
    bm.free(b)
    assert (bm.num_free, bm.num_used) == (6, 0) and bm.ref_counts == [0] * 6


def test_can_allocate_is_false_exactly_when_too_few_blocks_are_free():
    bm = BlockManager(3, 4)
    a = Seq()
    assert bm.can_allocate(a, 12) and not bm.can_allocate(a, 13)
    other = Seq()
    bm.allocate(other, 1)
    assert bm.can_allocate(a, 8) and not bm.can_allocate(a, 9)
    bm.allocate(a, 5)                               # a holds two blocks: none free, but its own slots suffice
    assert bm.num_free == 0
    assert bm.can_allocate(a, 8) and not bm.can_allocate(a, 9)
    assert bm.can_allocate(Seq(), 0) and not bm.can_allocate(Seq(), 1)


def test_allocating_more_than_is_free_raises_and_takes_nothing():
    bm = BlockManager(3, 4)
    a = Seq()
    bm.allocate(a, 4)
    with pytest.raises(RuntimeError, match="3 blocks needed, 2 free"):
        bm.allocate(a, 13)
    assert a.block_table == [0] and bm.num_free == 2 and bm.ref_counts == [1, 0, 0]


def test_freeing_twice_or_an_unknown_sequence_is_a_no_op():
    bm = BlockManager(4, 4)
    a, b = Seq(), Seq()
    bm.allocate(a, 5)
    bm.allocate(b, 4)
    bm.free(a)
    free_list = list(bm.free_blocks)
    bm.free(a)                                      # its table is empty: nothing happens
    bm.free(Seq())                                  # never allocated: nothing happens
    assert list(bm.free_blocks) == free_list and bm.num_used == 1
    assert bm.ref_counts == [0, 0, 1, 0] and b.block_table == [2]


def test_shared_prefix_blocks_are_freed_only_by_their_last_user():
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    a = Seq(list(range(12)))
    computed(bm, a)                                 # blocks 0, 1, 2, all full and registered
    b = Seq(list(range(8)) + [50, 51])
    assert bm.match_prefix(b) == 8 and b.block_table == [0, 1]
    bm.allocate(b, b.num_tokens)                    # its own third block
    assert b.block_table == [0, 1, 3] and bm.ref_counts[:4] == [2, 2, 1, 1] and bm.num_used == 4
    bm.free(a)                                      # only a's own block comes back
    assert bm.num_used == 3 and bm.ref_counts[:4] == [1, 1, 0, 1]
    assert 2 in bm.free_blocks and 0 not in bm.free_blocks and 1 not in bm.free_blocks
    filler = Seq()
    bm.allocate(filler, 4 * bm.num_free)           # every free block: never a shared one
    assert sorted(filler.block_table) == [2, 4, 5] and bm.num_free == 0
    assert not bm.can_allocate(Seq(), 1)
    bm.free(b)                                      # the last user: now they come back
    assert bm.num_free == 3 and bm.ref_counts[:2] == [0, 0]
    bm.free(filler)
    assert bm.num_used == 0 and bm.ref_counts == [0] * 6


def test_a_match_takes_cached_free_blocks_off_the_free_list():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a = Seq(list(range(8)))
    computed(bm, a)
    bm.free(a)
    assert bm.num_free == 4 and bm.ref_counts[:2] == [0, 0]
    b = Seq(list(range(9)))
    assert bm.match_prefix(b) == 8 and b.block_table == [0, 1]
    assert bm.num_free == 2 and 0 not in bm.free_blocks and 1 not in bm.free_blocks and bm.ref_counts[:2] == [1, 1]
    assert bm.match_prefix(b) == 0                  # it holds blocks already: no second match
    bm.free(b)
    assert list(bm.free_blocks) == [2, 3, 1, 0]     # back at the end: the most recently freed


def test_cached_free_blocks_are_reused_least_recently_freed_first_a_sequences_last_block_first():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a = Seq(list(range(12)))
    computed(bm, a)                                 # blocks 0, 1, 2; block 3 never used
    bm.free(a)
    assert list(bm.free_blocks) == [3, 2, 1, 0]
    assert len(bm.cached) == 3
    x = Seq()
    handed_out, still_cached = [], []
    for i in range(4):
        bm.allocate(x, 4 * (i + 1))
        handed_out.append(x.block_table[-1])
        still_cached.append(sorted(bm.cached.values()))
        assert sorted(bm.hash_of) == still_cached[-1]
    assert handed_out == [3, 2, 1, 0]               # the never-used block, then a's blocks from its end
    assert still_cached == [[0, 1, 2], [0, 1], [0], []]   # each reuse forgets exactly that block's key
    assert bm.cached == {} and bm.hash_of == {}


def test_the_sequence_freed_first_is_evicted_first():
    bm = BlockManager(2, 4, enable_prefix_caching=True)
    a, b = Seq([1, 2, 3, 4]), Seq([5, 6, 7, 8])
    computed(bm, a)
    computed(bm, b)
    bm.free(a)
    bm.free(b)
    x = Seq()
    bm.allocate(x, 4)
    assert x.block_table == [0]                     # a's block, freed first, goes first
    assert bm.match_prefix(Seq([1, 2, 3, 4, 9])) == 0
    assert bm.match_prefix(Seq([5, 6, 7, 8, 9])) == 4


def test_register_keys_only_full_computed_blocks_once():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = Seq(list(range(10)))
    bm.allocate(a, 10)
    a.num_computed_tokens = 7                       # one full block computed, the second not yet
    bm.register(a)
    assert len(a.block_hashes) == 1 and set(bm.hash_of) == {a.block_table[0]}
    a.num_computed_tokens = 10
    bm.register(a)
    bm.register(a)                                  # again: nothing new
    assert len(a.block_hashes) == 2 and set(bm.hash_of) == set(a.block_table[:2]) and len(bm.cached) == 2
    twin = Seq(list(range(10)))                     # the same tokens computed in blocks of its own
    computed(bm, twin)
    assert len(twin.block_hashes) == 2 and twin.block_hashes == a.block_hashes
    assert sorted(bm.cached.values()) == a.block_table[:2]   # the key stays with the first block
    assert bm.match_prefix(Seq(list(range(9)))) == 8
