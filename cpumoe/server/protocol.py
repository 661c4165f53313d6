"""The OpenAI wire format: request bodies (validated here, so bad input becomes a 400 before the engine sees it) and
response bodies. Spec: https://platform.openai.com/docs/api-reference (completions, chat, models, errors).

Fields that OpenAI defines but cpumoe does not implement are declared so that asking for them is a clear 400 that
names them (`n` > 1, `best_of` > 1, `logprobs`, `top_logprobs`, `echo`, `suffix`, penalties, `logit_bias`, tools
and function calls, a `response_format` other than text), never a 200 that quietly ignores them; their "off"
values (0, null, "none", {"type": "text"}) pass, as clients send them by default. Fields no one here knows about
are ignored, as OpenAI clients send extras freely. `top_k` and `ignore_eos` are extensions (as in vLLM): top_k 0 or -1 turn it off.
"""
from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_serializer, field_validator,
                      model_serializer)


# ---- errors -----------------------------------------------------------------------------------------------------

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests ---------------------------------------------------------------------------------------------------

# Strict: a JSON string or boolean where a number is wanted (and the reverse) is a 400, never coerced.
_STRICT = ConfigDict(extra="ignore", strict=True)
MAX_STOP_STRINGS = 4          # as OpenAI's API
MAX_STOP_CHARS = 1024         # each: a stop string is matched against the text after every token


def _utf8(text: str, what: str) -> str:
    """A str that cannot be UTF-8 (a lone surrogate from a JSON escape) is refused before any tokenizer sees it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode ({e.reason} at character {e.start})") from None
    return text


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What completions and chat share: the model and the sampling parameters."""
    model_config = _STRICT

    model: str
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)           # extension; 0 or -1: off
    ignore_eos: bool = False                         # extension (benchmarks): always produce max_tokens
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None             # not implemented: only 0
    frequency_penalty: float | None = None            # not implemented: only 0
    logit_bias: dict[str, float] | None = None        # not implemented: only empty

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value not in (None, 0):
            raise ValueError(f"{info.field_name} is not supported (only 0), got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias:
            raise ValueError("logit_bias is not supported")
        return bias

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for text in stops:
            if len(text) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {len(text)}")
            _utf8(text, "a stop string")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(16, gt=0)          # OpenAI's default for completions
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix (insertion) is not supported")
        return suffix

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, prompt: str | list[int]) -> str | list[int]:
        return _utf8(prompt, "the prompt") if isinstance(prompt, str) else prompt

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {best_of}")
        return best_of

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: int | None) -> int | None:
        if logprobs is not None:
            raise ValueError("logprobs are not supported")
        return logprobs

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _valid_text(cls, text: str) -> str:
        return _utf8(text, "a message")


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content")
    @classmethod
    def _valid_content(cls, content: str | list[TextPart]) -> str | list[TextPart]:
        return _utf8(content, "a message") if isinstance(content, str) else content

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)   # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, top: int | None) -> int | None:
        if top:
            raise ValueError("top_logprobs are not supported")
        return top

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, tools: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        if tools:
            raise ValueError(f"{info.field_name}: tool and function calling are not supported")
        return tools

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, choice: Any, info: ValidationInfo) -> Any:
        if choice not in (None, "none", "auto"):
            raise ValueError(f"{info.field_name}: tool and function calling are not supported")
        return choice

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, fmt: dict[str, Any] | None) -> dict[str, Any] | None:
        if fmt is not None and fmt.get("type") != "text":
            raise ValueError(f"response_format {fmt.get('type')!r} is not supported (only text)")
        return fmt

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: bool | None) -> bool | None:
        if logprobs:
            raise ValueError("logprobs are not supported")
        return logprobs

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses --------------------------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "cpumoe"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: Any = None
    finish_reason: str | None
    token_ids: list[int] | None = None   # the generated ids, when the server runs without a tokenizer (as vLLM's)

    @model_serializer(mode="wrap")
    def _ids_only_when_given(self, handler):
        data = handler(self)
        if data.get("token_ids") is None:
            data.pop("token_ids", None)
        return data


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: Any = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: Any = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def _sparse_delta(self, delta: Delta) -> dict:   # `{"content": "x"}`, as OpenAI sends it: no null role
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- streamed events --------------------------------------------------------------------------------------------

def _json(value: Any) -> str:
    """JSON as pydantic's model_dump_json writes it: compact, non-ASCII characters as they are."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class CompletionEvents:
    """The SSE events of one streamed completion, each the `data: ...` line of a CompletionResponse chunk with one
    choice, byte for byte as its model_dump_json (tests check the two agree). The part before the text is rendered
    once a response: a token's event is then two small json.dumps and a join. Building and serializing the models
    took the event loop about a third of its time a streamed token (README, "Serving under load")."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = (f'data: {{"id":{_json(request_id)},"object":"text_completion","created":{int(created)},'
                      f'"model":{_json(model)},"choices":[{{"index":0,"text":')

    def event(self, text: str, finish_reason: str | None, token_ids: list[int] | None = None) -> str:
        ids = "" if token_ids is None else f',"token_ids":{_json(token_ids)}'
        return (f'{self._head}{_json(text)},"logprobs":null,"finish_reason":{_json(finish_reason)}{ids}}}],'
                '"usage":null}\n\n')


class ChatEvents:
    """The same for a streamed chat completion: the `data: ...` line of a ChatCompletionChunk with one choice whose
    delta carries content only (the role goes out once, first, as a model)."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = (f'data: {{"id":{_json(request_id)},"object":"chat.completion.chunk","created":{int(created)},'
                      f'"model":{_json(model)},"choices":[{{"index":0,"delta":')

    def event(self, content: str | None, finish_reason: str | None = None) -> str:
        delta = "{}" if content is None else f'{{"content":{_json(content)}}}'
        return f'{self._head}{delta},"logprobs":null,"finish_reason":{_json(finish_reason)}}}],"usage":null}}\n\n'
