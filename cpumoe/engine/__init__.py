"""The inference engine: paged KV cache, continuous-batching scheduler, model runner, sync and async front ends.

    LLMEngine.step() = Scheduler.schedule() -> ModelRunner.run() -> LLMEngine.postprocess()

Submodules load on first use (`from cpumoe.engine import LLMEngine`), so `cpumoe.engine.api` stays light.
"""
from __future__ import annotations

from cpumoe.engine.api import RequestOutput, SamplingParams
from cpumoe.engine.config import EngineConfig

__all__ = ["AsyncEngine", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLMEngine":
        from cpumoe.engine.engine import LLMEngine
        return LLMEngine
    if name == "AsyncEngine":
        from cpumoe.engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
