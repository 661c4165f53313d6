"""Engine configuration: one slotted dataclass, checked once when the engine starts."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16                   # tokens per KV-cache block
    num_blocks: int | None = None          # KV-cache blocks; None: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 2 << 30          # KV-cache budget (all layers, K and V) when num_blocks is None
    max_num_batched_tokens: int = 512      # token budget of one step (decodes + prefill chunks)
    max_num_seqs: int = 64                 # running sequences at most
    max_model_len: int | None = None       # prompt + completion; None: the checkpoint's max_position_embeddings
    allow_long_max_model_len: bool = False # let max_model_len exceed max_position_embeddings (untrained positions)
    seed: int = 0                          # the engine's generator, for requests without a seed

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "kv_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"EngineConfig.num_blocks must be positive, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be at least 2, got {self.max_model_len}")
