"""Engine configuration: slotted dataclasses, checked once when the engine starts."""
from __future__ import annotations

import json
from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """As vLLM's --speculative-config takes it: {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 3} or {"method": "draft", "model": PATH, "num_speculative_tokens": 4}."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 3    # ngram: the longest suffix looked up in the sequence's earlier tokens
    prompt_lookup_min: int = 1    # ngram: the shortest
    model: str | None = None      # draft: a smaller checkpoint with the target's tokenizer

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}; got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative {name} must be a positive integer; got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min {self.prompt_lookup_min} is above prompt_lookup_max "
                             f"{self.prompt_lookup_max}")
        if (self.method == "draft") != (self.model is not None):
            raise ValueError("speculative method 'draft' needs a 'model' (a checkpoint directory), and only it "
                             "takes one")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From a JSON string or a dict (vLLM's keys; its method name "draft_model" is read as "draft")."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object; got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(unknown)} (known: "
                             f"{', '.join(sorted(known))})")
        missing = [k for k in ("method", "num_speculative_tokens") if k not in value]
        if missing and not (missing == ["method"] and "model" in value):
            raise ValueError(f"speculative config needs {' and '.join(missing)}")
        value = dict(value)
        method = value.pop("method", "draft")
        return cls(method="draft" if method == "draft_model" else method, **value)


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16                   # tokens per KV-cache block
    num_blocks: int | None = None          # KV-cache blocks; None: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 2 << 30          # KV-cache budget (all layers, K and V) when num_blocks is None
    # token budget of one step (decodes + prefill chunks). 2048: prompts that wait together prefill in one step,
    # whose expert GEMMs run at a better rate than four steps of 512 (measured: README, "Prefill steps and the step
    # budget")
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64                 # running sequences at most
    max_model_len: int | None = None       # prompt + completion; None: the checkpoint's max_position_embeddings
    allow_long_max_model_len: bool = False # let max_model_len exceed max_position_embeddings (untrained positions)
    seed: int = 0                          # the engine's generator, for requests without a seed
    enable_prefix_caching: bool = True     # share the KV blocks of prompt prefixes computed before (vLLM's default)
    speculative: SpeculativeConfig | None = None  # speculative decoding; None: off
    batch_invariant: bool = False          # a request's tokens never depend on its step's other tokens or chunking

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "kv_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"EngineConfig.num_blocks must be positive, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be at least 2, got {self.max_model_len}")
