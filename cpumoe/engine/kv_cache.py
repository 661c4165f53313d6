"""The paged KV cache: per layer K [num_blocks, block_size, kv_heads, k_dim] and V [.., kv_heads, v_dim] in the
model dtype, as the model's KVCacheLayout says, and the BlockManager that hands out their blocks to sequences.

    sequence token p lives in block seq.block_table[p // block_size], offset p % block_size
    (slot = block * block_size + offset, the row in the cache viewed as [num_blocks * block_size, kv_heads, d])
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Protocol

import torch

from cpumoe import ops
from cpumoe.attention.layout import KVCacheLayout
from cpumoe.memory import HUGE_PAGES_WANTED, advised_memory, huge_page_advice

logger = logging.getLogger(__name__)


class KVCache:
    """Each layer's K and V on memory of their own, asked for 2 MB pages: a decode step reads a sequence's keys
    block by block from anywhere in the cache, and on 4 KB pages every block was a TLB miss (served at concurrency
    16, where prefix caching and finished requests scatter the blocks: 103.7-104.8 -> 107.1-110.3 tok/s). Where the
    pages stay 4 KB, it says so."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, layout: KVCacheLayout,
                 dtype: torch.dtype):
        self.num_blocks, self.block_size, self.layout = num_blocks, block_size, layout
        k_shape = (num_blocks, block_size, layout.num_kv_heads, layout.k_dim)
        v_shape = (num_blocks, block_size, layout.num_kv_heads, layout.v_dim)
        first = ops.next_huge_mapping()
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (ops.zeros_on_huge_pages(k_shape, dtype), ops.zeros_on_huge_pages(v_shape, dtype))
            for _ in range(num_layers)]
        self.huge_pages = advised_memory(ops.huge_mappings_since(first))
        if self.huge_pages.share is not None and self.huge_pages.share < HUGE_PAGES_WANTED:
            logger.warning("KV cache: only %.0f%% of %.2f GB got 2 MB pages; decode attention reads the rest through "
                           "4 KB pages, more slowly (%s)", 100 * self.huge_pages.share, self.huge_pages.advised_gb,
                           huge_page_advice())

    @staticmethod
    def bytes_per_block(*, num_layers: int, block_size: int, layout: KVCacheLayout, dtype: torch.dtype) -> int:
        return block_size * layout.bytes_per_token(num_layers=num_layers, dtype=dtype)


class HasBlockTable(Protocol):
    block_table: list[int]


class HasCachedPrefix(HasBlockTable, Protocol):
    """What prefix caching reads of a sequence."""
    token_ids: list[int]
    num_computed_tokens: int
    block_hashes: list[int]    # the chained hash of each full, computed block of the table, in order


def block_hash(parent: int | None, tokens: list[int]) -> int:
    """A block's key: its tokens and, through the parent's hash, every token before them. Python's tuple hash is
    64 bits; a collision (two different prefixes, one key) is as likely as in vLLM's default builtin hash."""
    return hash((parent, tuple(tokens)))


class BlockManager:
    """A free list of block ids and each sequence's block table (kept on the sequence). Knows only sequences.

    With prefix caching, a block that holds block_size computed tokens is registered under block_hash; a sequence
    admitted later whose prompt starts with the same tokens takes those blocks into its table (reference counted)
    instead of computing them again. A freed block keeps its key until it is handed out again, least recently
    freed first (a sequence's last blocks are freed first, so its shared start stays longest). Shared blocks are
    never written: a sequence computes (and writes) only past its num_computed_tokens, which ends after them."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.ref_counts = [0] * num_blocks
        self.cached: dict[int, int] = {}        # block hash -> block
        self.hash_of: dict[int, int] = {}       # block -> its hash, for cached blocks
        self.prefix_queries = 0                 # prompt tokens looked up, and found
        self.prefix_hits = 0

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, seq: HasBlockTable, num_tokens: int) -> int:
        """More blocks seq needs so that its first num_tokens tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: HasBlockTable, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free_blocks)

    def allocate(self, seq: HasBlockTable, num_tokens: int) -> None:
        """Grow seq's block table to cover num_tokens tokens (allocate or append)."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"KV cache: {need} blocks needed, {len(self.free_blocks)} free")
        for _ in range(need):
            block, _ = self.free_blocks.popitem(last=False)
            key = self.hash_of.pop(block, None)
            if key is not None:       # reused: its old contents are no longer a cached prefix
                del self.cached[key]
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: HasBlockTable) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table.clear()

    def match_prefix(self, seq: HasCachedPrefix) -> int:
        """For a sequence with nothing in the cache: take the cached blocks its prompt starts with into its table.
        Returns the tokens they hold (its new num_computed_tokens). At least the last token is left to compute, so
        the step that samples has its logits, and it lands in a block of the sequence's own."""
        if not self.enable_prefix_caching or seq.block_table or seq.num_computed_tokens:
            return 0
        bs = self.block_size
        parent = None
        for i in range((seq.num_tokens - 1) // bs):
            key = block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            block = self.cached.get(key)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(key)
            parent = key
        return len(seq.block_table) * bs

    def record_prefix(self, num_tokens: int, hit_tokens: int) -> None:
        """Count an admitted prompt's lookup (once: a sequence can be looked up again while it waits for room)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += hit_tokens

    def register(self, seq: HasCachedPrefix) -> None:
        """Make seq's full, computed blocks findable by later prompts that start with the same tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # (a request that stopped inside accepted drafts holds fewer tokens than its cache computed)
        for i in range(len(seq.block_hashes), min(seq.num_computed_tokens, len(seq.token_ids)) // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            key = block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(key)
            block = seq.block_table[i]
            if key not in self.cached and block not in self.hash_of:
                self.cached[key] = block
                self.hash_of[block] = key
