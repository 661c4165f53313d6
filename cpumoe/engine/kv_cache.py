"""The paged KV cache: per layer K [num_blocks, block_size, kv_heads, k_dim] and V [.., kv_heads, v_dim] in the
model dtype, as the model's KVCacheLayout says, and the BlockManager that hands out their blocks to sequences.

    sequence token p lives in block seq.block_table[p // block_size], offset p % block_size
    (slot = block * block_size + offset, the row in the cache viewed as [num_blocks * block_size, kv_heads, d])
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """What one token of one layer keeps in the cache: K [num_kv_heads, k_dim] and V [num_kv_heads, v_dim].
    v_dim 0: no V (the layer reads its values out of K; MLA's latent cache). A model config declares its layout as
    a `kv_cache_layout` attribute; without one, K and V are num_key_value_heads x head_dim (GQA)."""
    num_kv_heads: int
    k_dim: int
    v_dim: int

    @classmethod
    def of(cls, config) -> "KVCacheLayout":
        layout = getattr(config, "kv_cache_layout", None)
        if layout is not None:
            return layout
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(num_kv_heads=config.num_key_value_heads, k_dim=head_dim, v_dim=head_dim)

    def bytes_per_token(self, *, num_layers: int, dtype: torch.dtype) -> int:
        """K and V of one token over all layers."""
        return num_layers * self.num_kv_heads * (self.k_dim + self.v_dim) * dtype.itemsize


class KVCache:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, layout: KVCacheLayout,
                 dtype: torch.dtype):
        self.num_blocks, self.block_size, self.layout = num_blocks, block_size, layout
        k_shape = (num_blocks, block_size, layout.num_kv_heads, layout.k_dim)
        v_shape = (num_blocks, block_size, layout.num_kv_heads, layout.v_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype)) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(*, num_layers: int, block_size: int, layout: KVCacheLayout, dtype: torch.dtype) -> int:
        return block_size * layout.bytes_per_token(num_layers=num_layers, dtype=dtype)


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
