"""A fake OpenAI server for the load generator's tests: streams tokens on a known schedule and records its load.

Each request's first token chunk goes out `ttft_s` after the request arrives, then one chunk every `step_s`
(times kept against the loop's clock, so they do not drift); a chunk carries `tokens_per_chunk` tokens (" t" each),
until `max_tokens` tokens. Both /v1/completions and /v1/chat/completions, streaming only, with the usage event
when asked (and `send_usage`). `fail(index, body)` may answer an HTTP error for the index-th request (0-based, in
arrival order): it returns (status, message) or None; `break_after` ends each stream early. The server records
the bodies, arrival times and the peak number of streams open at once.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "fake-model"


@dataclass
class FakeServer:
    ttft_s: float = 0.0
    step_s: float = 0.0
    tokens_per_chunk: int = 1
    send_usage: bool = True
    fail: Callable[[int, dict], tuple[int, str] | None] | None = None
    break_after: int | None = None   # token chunks after which a stream ends with an error event (or is cut off)
    cut_off: bool = False            # break_after: end the stream without the error event and [DONE]
    bodies: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)   # time.perf_counter() of each request
    open_streams: int = 0
    peak_streams: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}

        @app.post("/v1/completions")
        async def completions(raw: Request):
            return await self._answer(await raw.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(raw: Request):
            return await self._answer(await raw.json(), chat=True)

        return app

    async def _answer(self, body: dict, chat: bool):
        arrived = asyncio.get_running_loop().time()
        with self._lock:
            index = len(self.bodies)
            self.bodies.append(body)
            self.arrivals.append(time.perf_counter())
        failure = self.fail(index, body) if self.fail else None
        if failure:
            status, message = failure
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                                status_code=status)
        return StreamingResponse(self._events(body, chat, arrived), media_type="text/event-stream")

    async def _events(self, body: dict, chat: bool, arrived: float):
        loop = asyncio.get_running_loop()
        with self._lock:
            self.open_streams += 1
            self.peak_streams = max(self.peak_streams, self.open_streams)
        try:
            n, sent, k = body["max_tokens"], 0, 0
            if chat:
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            while sent < n:
                if self.break_after is not None and k == self.break_after:
                    if not self.cut_off:
                        yield _sse({"error": {"message": "engine died", "type": "internal_error", "code": 500}})
                        yield "data: [DONE]\n\n"
                    return
                await asyncio.sleep(max(0.0, arrived + self.ttft_s + k * self.step_s - loop.time()))
                m = min(self.tokens_per_chunk, n - sent)
                text = " t" * m
                choice = ({"index": 0, "delta": {"content": text}, "finish_reason": None} if chat
                          else {"index": 0, "text": text, "finish_reason": None})
                yield _sse({"choices": [choice]})
                sent, k = sent + m, k + 1
            yield _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"} if chat
                                    else {"index": 0, "text": "", "finish_reason": "length"}]})
            if self.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                yield _sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": sent,
                                                     "total_tokens": 7 + sent}})
            yield "data: [DONE]\n\n"
        finally:
            with self._lock:
                self.open_streams -= 1


def _sse(event: dict) -> str:
    return f"data: {json.dumps({'id': 'x', 'model': MODEL, **event})}\n\n"
