"""What the KV cache holds per token and layer: the contract between a model's attention and the engine's cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """What one token of one layer keeps in the cache: K [num_kv_heads, k_dim] and V [num_kv_heads, v_dim].
    v_dim 0: no V (the layer reads its values out of K; MLA's latent cache). Each architecture says its own
    (Architecture.kv_cache_layout)."""
    num_kv_heads: int
    k_dim: int
    v_dim: int

    def bytes_per_token(self, *, num_layers: int, dtype: torch.dtype) -> int:
        """K and V of one token over all layers."""
        return num_layers * self.num_kv_heads * (self.k_dim + self.v_dim) * dtype.itemsize
