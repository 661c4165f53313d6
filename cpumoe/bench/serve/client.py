"""The load generator's client: streamed OpenAI requests sent on an arrival schedule, timed chunk by chunk.

    prompts -> request bodies (JSON bytes, made before the clock starts)
            -> arrival schedule (gamma inter-arrival times, seeded) -> one task per request, at most C in flight
            -> POST, stream: SSE parsed as bytes arrive, time.perf_counter() taken at each network read
            -> RequestOutput (the timestamps of the chunks that carried tokens, the text, the usage)

One aiohttp ClientSession with a connection limit no lower than the concurrency, so no request waits for a
connection the client holds back. Metrics are computed afterwards from the timestamps (metrics.py).

What a "token chunk" is: an SSE event whose first choice carries text or the promise of it (completions: a `text`
or `token_ids`; chat: a `delta.content`), empty text included while the choice has no finish_reason: a server
streams one chunk per step that made tokens, and a token that is part of a character (or a special token) has no
text of its own yet. The chat role-only first event, a final event with only a finish_reason, the usage event and
[DONE] carry no token and are not timed. Events that arrive in one network read share its timestamp.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from cpumoe.bench.serve.datasets import Prompt

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
ERROR_TEXT_CHARS = 300      # of an error body kept in a request's error


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how requests go."""
    base_url: str               # http://host:port, no /v1
    model: str
    endpoint: str = "completions"   # a key of ENDPOINTS
    api_key: str | None = None
    ignore_eos: bool = True     # send ignore_eos and min_tokens, so each request makes exactly its output_len
    timeout_s: float = 6 * 3600.0

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


@dataclass(slots=True)
class RequestOutput:
    """One request as the client saw it; times are time.perf_counter() seconds."""
    prompt_len: int | None
    asked_output_len: int
    success: bool = False
    error: str = ""
    start: float = 0.0                  # just before the POST (after any wait for a concurrency slot)
    token_times: list[float] = field(default_factory=list)   # arrival of each token chunk
    generated_text: str = ""
    usage_output_tokens: int | None = None   # completion_tokens of the final usage, when sent
    usage_prompt_tokens: int | None = None
    output_tokens: int | None = None    # filled in afterwards: usage, else the tokenizer's count, else chunks

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start if self.token_times else 0.0

    @property
    def latency(self) -> float:
        """E2E: start to the last token chunk (as vLLM's benchmark times it)."""
        return self.token_times[-1] - self.start if self.token_times else 0.0

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def request_body(target: Target, prompt: Prompt, *, stream: bool = True) -> bytes:
    body: dict[str, Any] = {"model": target.model, "max_tokens": prompt.output_len, "temperature": 0.0,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if target.endpoint == "completions":
        body["prompt"] = prompt.prompt
    else:
        body["messages"] = prompt.prompt
    if target.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = prompt.output_len
    return json.dumps(body).encode()


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """When each of `n` requests is sent, seconds after the first: gamma inter-arrival times of shape
    `burstiness` and mean 1/rate (vLLM's definition: burstiness 1 is a Poisson process, lower is burstier,
    higher more regular). rate inf: all at 0. The first request goes at 0."""
    if rate == float("inf"):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)  # [n]
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def stream_request(session: aiohttp.ClientSession, target: Target, body: bytes, out: RequestOutput) -> None:
    """POST `body`, read the SSE stream and record into `out`; never raises for a failed request."""
    chat = target.endpoint == "chat"
    texts: list[str] = []
    done = False
    out.start = time.perf_counter()
    try:
        async with session.post(target.url, data=body, headers=target.headers()) as resp:
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:ERROR_TEXT_CHARS]
                out.error = f"HTTP {resp.status}: {_error_message(text)}"
                return
            buffer = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue    # blank separators, comments, event: lines
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    event = json.loads(payload)
                    if not isinstance(event, dict):
                        out.error = f"a stream event is not a JSON object: {payload[:100]!r}"
                        return
                    if "error" in event:
                        error = event["error"]
                        out.error = f"stream error: {error.get('message', error) if isinstance(error, dict) else error}"
                        return
                    text = _token_text(event, chat)
                    if text is not None:
                        out.token_times.append(now)
                        texts.append(text)
                    if usage := event.get("usage"):
                        out.usage_output_tokens = usage.get("completion_tokens")
                        out.usage_prompt_tokens = usage.get("prompt_tokens")
                if done:
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"[:ERROR_TEXT_CHARS]
        return
    out.generated_text = "".join(texts)
    if not done:    # OpenAI-compatible servers end every stream with [DONE]: without it, the answer was cut off
        out.error = f"the stream ended before [DONE], after {len(out.token_times)} token chunks"
        return
    if not out.token_times:
        out.error = "the stream ended without a token"
        return
    out.success = True


def _token_text(event: dict, chat: bool) -> str | None:
    """The text a stream event carries, or None when it carries no token (see the module docstring)."""
    choices = event.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    open_ = choice.get("finish_reason") is None
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if "role" in delta or text is None:   # the role-only first event; a delta without content
            return None
        return text if text or open_ else None
    text = choice.get("text")
    if text or (text is not None and open_):
        return text
    return "" if choice.get("token_ids") else None   # a server without a tokenizer streams ids only


def _error_message(text: str) -> str:
    """The `error.message` of an OpenAI error body, else the body itself."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error)
    return text.strip()


@dataclass(frozen=True, slots=True)
class Load:
    """How requests arrive."""
    request_rate: float = float("inf")     # requests/s; inf: all at once
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0


async def run_load(target: Target, prompts: list[Prompt], load: Load) -> tuple[list[RequestOutput], float]:
    """Send every prompt on `load`'s schedule; returns the outputs (in prompt order) and the duration in seconds
    (first send to last answer)."""
    bodies = [request_body(target, p) for p in prompts]
    offsets = arrival_offsets(len(prompts), load.request_rate, load.burstiness, load.seed)  # [n] seconds
    outputs = [RequestOutput(prompt_len=p.prompt_len, asked_output_len=p.output_len) for p in prompts]
    slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    connections = load.max_concurrency or len(prompts)
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=connections, force_close=False)
    timeout = aiohttp.ClientTimeout(total=target.timeout_s)

    async def one(i: int) -> None:
        if slots is None:
            await stream_request(session, target, bodies[i], outputs[i])
            return
        async with slots:
            await stream_request(session, target, bodies[i], outputs[i])

    with _heap_frozen():
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=2**16) as session:
            tasks = []
            start = time.perf_counter()
            for i, offset in enumerate(offsets):
                delay = start + float(offset) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
    return outputs, duration


@contextlib.contextmanager
def _heap_frozen():
    """The client times chunk arrivals: what was there before the load (aiohttp, numpy, a tokenizer: ~220k objects)
    is kept out of the garbage collector's full passes while it runs. Each such pass stopped the client for
    210-245 ms on a 2-core Zen 3 VM, which the results would show as the server's inter-token latency. Left as it is
    when something froze the heap already (a server in this process)."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def list_models(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> list[str]:
    """The ids of the server's /v1/models. Raises ConnectionError when the server cannot be reached and
    ValueError when it answers something else than a model list."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(base_url + "/v1/models", headers=headers) as resp:
                text = await resp.text(errors="replace")
                if resp.status != 200:
                    hint = " (check --api-key)" if resp.status in (401, 403) else ""
                    raise ValueError(f"GET {base_url}/v1/models answered HTTP {resp.status}: "
                                     f"{_error_message(text[:ERROR_TEXT_CHARS])}{hint}")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise ConnectionError(f"cannot reach {base_url}: {type(e).__name__}: {e}") from None
    try:
        return [m["id"] for m in json.loads(text)["data"]]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"GET {base_url}/v1/models did not answer an OpenAI model list: {text[:200]!r}") from None
