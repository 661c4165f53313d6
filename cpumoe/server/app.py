"""An OpenAI-compatible HTTP front end over any engine that implements `EngineClient`.

    HTTP body -> pydantic request (protocol.py; bad input: 400 in OpenAI's error format)
      -> prompt token ids (tokenizer / chat template) -> length checks -> SamplingParams
      -> engine.generate(request_id, ids, params): RequestOutput per step
      -> one JSON response, or SSE chunks `data: {...}` ending with `data: [DONE]`

Every request's outputs pass through `_outputs`, which times them for /metrics and, when the request ends before
the engine finished it (the client went away, a stream was closed, an error), calls engine.abort so that the
engine frees its KV blocks. The request id given to the engine is the id of the response (`cmpl-...`,
`chatcmpl-...`), so logs and metrics on both sides name the same thing.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (with the API key, when one is set),
GET /health, GET /metrics (without).
"""
from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from cpumoe.engine.api import EngineShutdown, RequestOutput, SamplingParams
from cpumoe.server.limits import MAX_REQUEST_BYTES
from cpumoe.server.metrics import ServerMetrics
from cpumoe.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                    ChatCompletionRequest, ChatCompletionResponse, ChatEvents, CompletionChoice,
                                    CompletionEvents, CompletionRequest, CompletionResponse, Delta, ErrorInfo,
                                    ErrorResponse, ModelCard, ModelList, SamplingRequest, Usage)

log = logging.getLogger("cpumoe.server")


class EngineClient(Protocol):
    """What the server needs from an engine (cpumoe.engine.async_engine.AsyncEngine implements it)."""
    tokenizer: Any          # transformers fast tokenizer: encode(text), apply_chat_template(...), len()
    max_model_len: int
    model_name: str

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict: ...   # running, waiting, kv_blocks_used, kv_blocks_total


class APIError(Exception):
    """An error the client caused (or, with 5xx, the server): answered in OpenAI's error format."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status)




def create_app(engine: EngineClient, *, model_name: str, api_key: str | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """max_request_bytes: a larger request body is refused with 413 before it is read whole or parsed."""
    app = FastAPI(title="cpumoe", summary="OpenAI-compatible Mixture-of-Experts inference on CPUs")
    metrics = ServerMetrics(engine.stats)
    app.state.engine, app.state.metrics = engine, metrics
    app.add_middleware(_BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:  # added last, so outermost: a request without the key is refused before its body is read
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    _add_error_handlers(app)

    # ---- request -> prompt ids and SamplingParams --------------------------------------------------------------

    def check_model(body: SamplingRequest) -> None:
        if body.model != model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")

    no_tokenizer = engine.tokenizer is None   # cpumoe serve --skip-tokenizer-init: token ids in, token ids out

    # A token spans at most this many characters (the vocabulary's longest string: bytes, or byte-level symbols,
    # are never fewer than the characters they decode to), so text past max_model_len of them cannot fit; a prompt
    # of megabytes has only that much of it tokenized before it is refused, not seconds of a core's time.
    chars_per_token = 1 if no_tokenizer else max(map(len, engine.tokenizer.get_vocab()), default=1)

    def refuse_if_too_long(text: str, param: str) -> None:
        """Raises context_length_exceeded when the first max_model_len * chars_per_token + 1 characters of a text
        longer than that are already a context of tokens; the rest is never tokenized."""
        fits = engine.max_model_len * chars_per_token
        if len(text) > fits:
            head = engine.tokenizer.encode(text[:fits + 1])
            if len(head) >= engine.max_model_len:
                raise APIError(400, f"the {param} has {len(text)} characters and its first {fits + 1} alone are "
                                    f"{len(head)} tokens; this model's context is {engine.max_model_len} tokens "
                                    "(max_model_len)", param=param, code="context_length_exceeded")

    def tokenize(text: str) -> list[int]:
        refuse_if_too_long(text, "prompt")
        return list(engine.tokenizer.encode(text))

    def completion_prompt(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if no_tokenizer:
                raise APIError(400, "this server runs without a tokenizer (--skip-tokenizer-init): send the prompt "
                                    "as token ids", param="prompt")
            return tokenize(prompt)
        # ids both the tokenizer and the model's embedding know (a tokenizer may be larger than the model)
        vocab = engine.vocab_size if no_tokenizer else min(len(engine.tokenizer),
                                                          getattr(engine, "vocab_size", len(engine.tokenizer)))
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", param="prompt")
        return list(prompt)

    def chat_prompt(body: ChatCompletionRequest) -> list[int]:
        if no_tokenizer:
            raise APIError(400, "chat needs the model's tokenizer and this server runs without one "
                                "(--skip-tokenizer-init); use /v1/completions with token ids", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        refuse_if_too_long("".join(m["content"] for m in messages), "messages")
        try:
            ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:   # a template may raise on a conversation it does not accept (roles, order)
            raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from None
        if isinstance(ids, Mapping):   # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def sampling_params(body: SamplingRequest, n_prompt: int, max_tokens: int | None,
                        prompt_param: str) -> SamplingParams:
        limit = engine.max_model_len
        if no_tokenizer and body.stop_list():
            raise APIError(400, "stop strings need a tokenizer; this server runs without one", param="stop")
        if n_prompt == 0:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        if n_prompt >= limit:
            raise APIError(400, f"the prompt has {n_prompt} tokens; this model's context is {limit} tokens "
                                f"(max_model_len), which leaves no room to generate", param=prompt_param,
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - n_prompt
        elif n_prompt + max_tokens > limit:
            raise APIError(400, f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) exceed this "
                                f"model's context of {limit} tokens (max_model_len)", param="max_tokens",
                           code="context_length_exceeded")
        try:
            return SamplingParams(max_tokens=max_tokens,
                                  temperature=1.0 if body.temperature is None else body.temperature,
                                  top_p=1.0 if body.top_p is None else body.top_p,
                                  top_k=max(body.top_k or 0, 0), seed=body.seed, stop=body.stop_list(),
                                  ignore_eos=body.ignore_eos)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    # ---- the engine's outputs ----------------------------------------------------------------------------------

    async def outputs(request_id: str, prompt_ids: list[int],
                      params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one request, timed; aborts the request if it ends before the engine is done."""
        timer = metrics.start(len(prompt_ids))
        finish_reason = None
        try:
            async with aclosing(engine.generate(request_id, prompt_ids, params)) as engine_outputs:
                async for out in engine_outputs:
                    timer.output(len(out.new_token_ids))
                    if out.finished:
                        finish_reason = out.finish_reason or "stop"
                    yield out
                    if out.finished:
                        break
        except EngineShutdown as e:   # the shutdown grace period ended: an error event, or a 503
            raise APIError(503, str(e), type="server_error", code="server_shutting_down") from None
        finally:
            if finish_reason is None:
                log.info("aborting %s", request_id)
                with anyio.CancelScope(shield=True):   # runs even while the stream's task is being cancelled
                    await engine.abort(request_id)
            timer.finish(finish_reason)

    async def collect(raw: Request, request_id: str, prompt_ids: list[int],
                      params: SamplingParams) -> tuple[str, str | None, Usage, list[int]]:
        """A whole non-streaming generation: (text, finish_reason, usage, token ids)."""
        parts, ids, finish_reason, n_generated = [], [], None, 0
        async with aclosing(outputs(request_id, prompt_ids, params)) as outs:
            try:
                async for out in outs:
                    parts.append(out.new_text)
                    ids += out.new_token_ids
                    n_generated = out.completion_tokens or n_generated + len(out.new_token_ids)
                    if out.finished:
                        finish_reason = out.finish_reason or "stop"
                    elif await raw.is_disconnected():   # nobody to answer: aclosing aborts the request
                        raise APIError(499, "the client disconnected", code="client_disconnected")
            except ValueError as e:   # the engine refused the request (AsyncEngine.generate documents ValueError)
                raise APIError(400, str(e)) from None
        return "".join(parts), finish_reason, _usage(len(prompt_ids), n_generated), ids

    # ---- endpoints ---------------------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=engine.max_model_len)])

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body)
        # tokenizing a long prompt takes a while: in a worker thread, so other requests' streams go on
        prompt_ids = await anyio.to_thread.run_sync(completion_prompt, body.prompt)
        params = sampling_params(body, len(prompt_ids), body.max_tokens, "prompt")
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish_reason: str | None, ids: list[int] | None = None) -> CompletionResponse:
            choice = CompletionChoice(text=text, finish_reason=finish_reason, token_ids=ids if no_tokenizer else None)
            return CompletionResponse(id=request_id, created=created, model=model_name, choices=[choice])

        if body.stream:
            token_events = CompletionEvents(request_id, created, model_name)

            async def events() -> AsyncIterator[str]:
                n_generated = 0
                async with aclosing(outputs(request_id, prompt_ids, params)) as outs:
                    async for out in outs:
                        n_generated = out.completion_tokens or n_generated + len(out.new_token_ids)
                        # a chunk per step that made tokens, with empty text while they end inside a character
                        # (as vLLM streams): a client times every step, not just those that completed a character
                        if out.new_text or out.finished or out.new_token_ids:
                            yield token_events.event(out.new_text, out.finish_reason if out.finished else None,
                                                     out.new_token_ids if no_tokenizer else None)
                if body.include_usage():
                    final = chunk("", None)
                    final.choices, final.usage = [], _usage(len(prompt_ids), n_generated)
                    yield _sse(final)
            return _EventStream(_guarded(events()))

        text, finish_reason, usage, ids = await collect(raw, request_id, prompt_ids, params)
        response = chunk(text, finish_reason, ids)
        response.usage = usage
        return response

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        check_model(body)
        prompt_ids = await anyio.to_thread.run_sync(chat_prompt, body)  # off the event loop, as completions
        params = sampling_params(body, len(prompt_ids), body.max_new_tokens(), "messages")
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        if body.stream:
            def chunk(delta: Delta | None, finish_reason: str | None = None) -> ChatCompletionChunk:
                choices = [] if delta is None else [ChatChunkChoice(delta=delta, finish_reason=finish_reason)]
                return ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=choices)

            token_events = ChatEvents(request_id, created, model_name)

            async def events() -> AsyncIterator[str]:
                yield _sse(chunk(Delta(role="assistant", content="")))
                n_generated = 0
                async with aclosing(outputs(request_id, prompt_ids, params)) as outs:
                    async for out in outs:
                        n_generated = out.completion_tokens or n_generated + len(out.new_token_ids)
                        if out.new_text or (out.new_token_ids and not out.finished):   # as completions
                            yield token_events.event(out.new_text)
                        if out.finished:
                            yield token_events.event(None, out.finish_reason or "stop")
                if body.include_usage():
                    final = chunk(None)
                    final.usage = _usage(len(prompt_ids), n_generated)
                    yield _sse(final)
            return _EventStream(_guarded(events()))

        text, finish_reason, usage, _ = await collect(raw, request_id, prompt_ids, params)
        return ChatCompletionResponse(id=request_id, created=created, model=model_name, usage=usage,
                                      choices=[ChatChoice(message=AssistantMessage(content=text),
                                                          finish_reason=finish_reason)])

    return app


# ---- helpers ----------------------------------------------------------------------------------------------------

def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def _sse(payload) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events, then `data: [DONE]`; an error after the headers went out becomes an error event (the
    status can no longer change)."""
    async with aclosing(events):
        try:
            async for event in events:
                yield event
        except APIError as e:
            yield _sse(ErrorResponse(error=ErrorInfo(message=e.message, type=e.type, param=e.param, code=e.code)))
        except Exception as e:
            log.exception("stream failed")
            yield _sse(ErrorResponse(error=ErrorInfo(message=f"internal error: {e}", type="internal_server_error")))
    yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends, however it ends: closing it is
    what aborts an unfinished request in the engine (see `outputs`)."""
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


class _BodyLimitMiddleware:
    """413 in OpenAI's error format for a body over max_bytes: at once when Content-Length says so, else as soon as
    the bytes read pass it (a chunked body), before the app parses any of it. Smaller bodies reach the app whole."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(413, f"the request body is over this server's limit of {self.max_bytes} bytes "
                                  "(cpumoe serve --max-request-mb)", code="request_too_large")
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await too_large.response()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":   # the client went away
                await self.app(scope, _replay([message]), send)
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await too_large.response()(scope, receive, send)
                return
            chunks.append(message)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(chunks, receive), send)


def _replay(messages: list[dict], then=None):
    """An ASGI receive that hands out `messages`, then defers to `then` (e.g. to see a disconnect)."""
    pending = list(messages)

    async def receive():
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}
    return receive


class _APIKeyMiddleware:
    """`Authorization: Bearer KEY` on /v1/*, checked before anything else (even before the body is parsed)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self._expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self._expected):
                message = "Incorrect API key provided" if given else "Missing API key (Authorization: Bearer KEY)"
                await APIError(401, message, code="invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return APIError(400, f"malformed JSON body: {detail}".rstrip(": ")).response()
        if tuple(first.get("loc", ())) == ("body",):   # not an object: a JSON list, a form, nothing
            return APIError(400, "the body must be a JSON object (Content-Type: application/json); "
                                 f"{first.get('msg', '')}").response()
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        messages = [f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body') or 'body'}: {err.get('msg')}"
                    for err in errors]
        return APIError(400, "; ".join(messages) or "invalid request", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("request failed")
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="internal_server_error").response()
