"""The engine's public types, shared by the engine, the sampler/detokenizer and the server.

    Request(prompt_token_ids, SamplingParams) -> engine steps -> RequestOutput per step (new token ids, new text,
    finish_reason once finished)
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0: off
    seed: int | None = None           # per-request generator; None: the engine's
    stop: list[str] = field(default_factory=list)            # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's eos
    ignore_eos: bool = False          # benchmarks: always produce max_tokens

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request."""
    request_id: str
    new_token_ids: list[int]
    new_text: str                     # detokenized text completed by this step (never a split UTF-8 character)
    finished: bool = False
    finish_reason: str | None = None  # "stop" (eos, stop token or stop string) | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0        # so far
    error: str | None = None          # with finish_reason "error": why this request alone failed


class EngineShutdown(RuntimeError):
    """The engine was drained (the server is shutting down) before this request finished."""
