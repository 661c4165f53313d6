"""One `cpumoe bench serve` call: the prompts made once, then one timed run per request rate.

    ServeBench (what to run) -> prompts (datasets.py, before any clock) -> for each rate: run_load (client.py)
    -> output token counts resolved -> compute_metrics (metrics.py) -> RateResult
    -> vLLM's result-file object (result_json) and the results database's `serve` row (db_case, db_metrics)

Output tokens of a request, in order of trust: the `completion_tokens` of the usage event the server sends at the
end of the stream (asked for with stream_options.include_usage); else the client tokenizer's count of the streamed
text; else the number of token chunks (exact only for a server that streams one token per chunk).
"""
from __future__ import annotations

import asyncio
import collections
import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpumoe.bench.serve.client import Load, RequestOutput, Target, run_load
from cpumoe.bench.serve.datasets import LengthRange, Prompt, Tokenizer, jsonl_prompts, random_prompts
from cpumoe.bench.serve.metrics import compute_metrics

BACKENDS = {"completions": "openai", "chat": "openai-chat"}   # vLLM's names of the two endpoints
SHOWN_ERRORS = 5      # distinct error messages a report lists


@dataclass(frozen=True, slots=True)
class ServeBench:
    target: Target
    label: str
    dataset: str = "random"                 # "random" or a JSONL file
    input_len: LengthRange = LengthRange(512, 512)
    output_len: LengthRange = LengthRange(128, 128)
    num_prompts: int = 100
    request_rates: tuple[float, ...] = (float("inf"),)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    goodput: dict[str, float] | None = None  # SLOs, ms
    tokenizer: str | None = None             # its path, for the result file

    def load(self, rate: float) -> Load:
        return Load(request_rate=rate, burstiness=self.burstiness, max_concurrency=self.max_concurrency,
                    seed=self.seed)


@dataclass(slots=True)
class RateResult:
    request_rate: float
    outputs: list[RequestOutput]
    metrics: dict[str, Any]
    date: str
    output_len_sources: dict[str, int] = field(default_factory=dict)   # "usage"/"tokenizer"/"chunks" -> requests
    warnings: list[str] = field(default_factory=list)

    def errors(self) -> list[tuple[str, int]]:
        """The distinct errors of the failed requests, most frequent first, with their counts."""
        return collections.Counter(o.error for o in self.outputs if not o.success).most_common()


PROMPT_SEED_STRIDE = 1_000_003   # rate i of a sweep draws its random prompts with seed + i x this


def make_prompts(bench: ServeBench, tokenizer: Tokenizer | None, round_: int = 0) -> list[Prompt]:
    """The prompts of one request rate. Random prompts are drawn anew for each rate of a sweep (seed + round_): the
    same prompts again would be served from a prefix cache filled by the rate before, and time the cache. A JSONL
    dataset is what it is: every rate sends it."""
    if bench.dataset == "random":
        if tokenizer is None:
            raise ValueError("--dataset random needs a tokenizer to make and count its prompts: pass --tokenizer "
                             "(a Hugging Face tokenizer directory or tokenizer.json)")
        return random_prompts(tokenizer, num_prompts=bench.num_prompts, input_len=bench.input_len,
                              output_len=bench.output_len, endpoint=bench.target.endpoint,
                              seed=bench.seed + PROMPT_SEED_STRIDE * round_)
    return jsonl_prompts(bench.dataset, tokenizer, num_prompts=bench.num_prompts, output_len=bench.output_len,
                         endpoint=bench.target.endpoint, seed=bench.seed)


def prompt_warnings(prompts: list[Prompt]) -> list[str]:
    short = [p for p in prompts if p.asked_input_len is not None and p.prompt_len != p.asked_input_len]
    if not short:
        return []
    worst = max(short, key=lambda p: abs(p.prompt_len - p.asked_input_len))
    return [f"{len(short)} of {len(prompts)} random prompts are not exactly their asked length after the "
            f"decode/encode rounds (worst: {worst.prompt_len} tokens for {worst.asked_input_len}); the real counts "
            f"are used"]


def resolve_output_tokens(outputs: list[RequestOutput], tokenizer: Tokenizer | None) -> dict[str, int]:
    """Set each completed request's output_tokens (see the module docstring); returns how many came from where."""
    sources: collections.Counter[str] = collections.Counter()
    for out in outputs:
        if not out.success:
            continue
        if out.usage_output_tokens is not None:
            out.output_tokens, source = out.usage_output_tokens, "usage"
        elif tokenizer is not None:
            out.output_tokens, source = tokenizer.count(out.generated_text), "tokenizer"
        else:
            out.output_tokens, source = len(out.token_times), "chunks"
        sources[source] += 1
    return dict(sources)


def output_warnings(outputs: list[RequestOutput]) -> list[str]:
    off = [o for o in outputs if o.success and o.output_tokens != o.asked_output_len]
    if not off:
        return []
    examples = ", ".join(f"{o.output_tokens} for {o.asked_output_len}" for o in off[:3])
    done = sum(o.success for o in outputs)
    return [f"{len(off)} of {done} completed requests got another output length than asked ({examples}"
            f"{', ...' if len(off) > 3 else ''}): the server stopped early or ran past max_tokens (does it honour "
            f"ignore_eos?)"]


def run_rate(bench: ServeBench, prompts: list[Prompt], rate: float, tokenizer: Tokenizer | None) -> RateResult:
    date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    outputs, duration = asyncio.run(run_load(bench.target, prompts, bench.load(rate)))
    sources = resolve_output_tokens(outputs, tokenizer)
    metrics = compute_metrics(outputs, duration, bench.goodput)
    return RateResult(request_rate=rate, outputs=outputs, metrics=metrics, date=date, output_len_sources=sources,
                      warnings=output_warnings(outputs))


def rate_value(rate: float) -> float | str:
    """A rate as vLLM's result file and the database write it: a number, or "inf"."""
    return "inf" if rate == float("inf") else rate


def result_json(bench: ServeBench, result: RateResult) -> dict[str, Any]:
    """The object `vllm bench serve --save-result` writes, for one rate (times of per-request lists in seconds)."""
    outputs = result.outputs
    return {
        "date": result.date,
        "backend": BACKENDS[bench.target.endpoint],
        "label": bench.label,
        "model_id": bench.target.model,
        "tokenizer_id": bench.tokenizer,
        "num_prompts": bench.num_prompts,
        "request_rate": rate_value(result.request_rate),
        "burstiness": bench.burstiness,
        "max_concurrency": bench.max_concurrency,
        **result.metrics,
        "input_lens": [o.prompt_len if o.prompt_len is not None else o.usage_prompt_tokens for o in outputs],
        "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
        "ttfts": [o.ttft if o.success else 0.0 for o in outputs],
        "itls": [o.itl if o.success else [] for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }


def db_case(bench: ServeBench, rate: float) -> dict[str, Any]:
    def length(r: LengthRange) -> int | str:
        return r.lo if r.lo == r.hi else str(r)

    random = bench.dataset == "random"
    return {"label": bench.label, "base_url": bench.target.base_url, "model": bench.target.model,
            "endpoint": bench.target.endpoint, "dataset": "random" if random else Path(bench.dataset).name,
            "input_len": length(bench.input_len) if random else None, "output_len": length(bench.output_len),
            "num_prompts": bench.num_prompts, "request_rate": rate_value(rate), "burstiness": bench.burstiness,
            "max_concurrency": bench.max_concurrency, "seed": bench.seed}


PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


def db_metrics(result: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The database row's metrics: the result file's run-wide keys (not its per-request lists), and `extra`."""
    return {k: v for k, v in result.items() if k not in PER_REQUEST_KEYS} | extra
