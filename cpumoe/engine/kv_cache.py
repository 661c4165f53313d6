"""The paged KV cache: per layer K and V tensors [num_blocks, block_size, kv_heads, head_dim] in the model dtype,
and the BlockManager that hands out their blocks to sequences.

    sequence token p lives in block seq.block_table[p // block_size], offset p % block_size
    (slot = block * block_size + offset, the row in the cache viewed as [num_blocks * block_size, kv_heads, d])
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

import torch


class KVCache:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


class HasBlockTable(Protocol):
    block_table: list[int]


class BlockManager:
    """A free list of block ids and each sequence's block table (kept on the sequence). Knows only sequences."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

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
        seq.block_table.extend(self.free_blocks.popleft() for _ in range(need))

    def free(self, seq: HasBlockTable) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table.clear()
