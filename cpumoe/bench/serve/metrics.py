"""A run's metrics from its requests' recorded timestamps: a pure function, as `vllm bench serve` defines them.

Per completed request (failed ones count only in `failed`):
    TTFT  first token chunk - start
    E2EL  last token chunk - start
    TPOT  (E2EL - TTFT) / (output tokens - 1), for requests of more than one output token
    ITL   every gap between consecutive token chunks (a chunk carrying several tokens is one gap, not several)
Run-wide: request_throughput = completed / duration; output_throughput = output tokens / duration;
total_token_throughput = (input + output tokens) / duration; request_goodput = completed requests meeting every
given SLO (ttft, tpot, e2el in ms; a one-token request's TPOT counts as 0) / duration.
Summary statistics: mean, median, std (population) and percentiles with numpy's linear interpolation; times in ms.
A statistic of no samples is None.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from cpumoe.bench.serve.client import RequestOutput

PERCENTILES = (90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


def summary(name: str, seconds: Iterable[float], percentiles: Iterable[int] = PERCENTILES) -> dict[str, float | None]:
    """mean/median/std/pN of `seconds`, in ms, keyed as vLLM's result file keys them (mean_ttft_ms, ...)."""
    values = np.asarray(list(seconds), dtype=np.float64) * 1000.0   # [n] ms
    empty = values.size == 0
    stats = {f"mean_{name}_ms": None if empty else float(values.mean()),
             f"median_{name}_ms": None if empty else float(np.median(values)),
             f"std_{name}_ms": None if empty else float(values.std())}
    for p in percentiles:
        stats[f"p{p}_{name}_ms"] = None if empty else float(np.percentile(values, p))
    return stats


def tpot(out: RequestOutput) -> float | None:
    """(E2EL - TTFT) / (output tokens - 1), None for a request of fewer than two output tokens."""
    n = out.output_tokens or 0
    return (out.latency - out.ttft) / (n - 1) if n > 1 else None


def compute_metrics(outputs: list[RequestOutput], duration: float,
                    goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """The run's metrics (keys as in the module docstring and vLLM's result file). `goodput`: SLOs in ms, keys
    among SLO_METRICS. Each output's `output_tokens` must be set (run.resolve_output_tokens)."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    done = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in done]
    e2els = [o.latency for o in done]
    tpots = [t for t in map(tpot, done) if t is not None]
    itls = [gap for o in done for gap in o.itl]
    total_input = sum(input_tokens(o) or 0 for o in done)
    total_output = sum(o.output_tokens or 0 for o in done)

    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    if goodput:
        metrics["request_goodput"] = sum(meets_slos(o, goodput) for o in done) / duration
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(summary(name, values))
    return metrics


def meets_slos(out: RequestOutput, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (ms) in `slos_ms`."""
    values = {"ttft": out.ttft, "tpot": tpot(out) or 0.0, "e2el": out.latency}   # seconds
    for name, limit_ms in slos_ms.items():
        if name not in values:
            raise ValueError(f"unknown SLO metric {name!r}; expected one of {', '.join(SLO_METRICS)}")
        if values[name] * 1000.0 > limit_ms:
            return False
    return True


def input_tokens(out: RequestOutput) -> int | None:
    """The prompt's tokens: the client tokenizer's count, else the server's usage."""
    return out.prompt_len if out.prompt_len is not None else out.usage_prompt_tokens
