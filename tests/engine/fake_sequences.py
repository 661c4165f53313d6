"""A sequence as the block manager sees it, without a model: its tokens, how many are computed, its block table."""
from dataclasses import dataclass, field

from cpumoe.engine.kv_cache import BlockManager


@dataclass(eq=False)
class Seq:
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def computed(bm: BlockManager, seq: Seq) -> None:
    """As a step that computes the whole of seq: blocks allocated, tokens computed, full blocks registered."""
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register(seq)
