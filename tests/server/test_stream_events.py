# The streamed events rendered from a per-response prefix (CompletionEvents, ChatEvents) against the pydantic chunk
# models they stand in for: the same bytes for every text, finish reason and id list, odd characters included.
import json

import pytest

from cpumoe.server.protocol import (ChatChunkChoice, ChatCompletionChunk, ChatEvents, CompletionChoice,
                                    CompletionEvents, CompletionResponse, Delta)

TEXTS = ["", " alpha", "é", "😀 two\nlines", 'quote " and \\ backslash', "\t\b\f\r\x00\x01\x1f\x7f",
         "\u2028\u2029", "中文", "</script>"]
IDS = [("cmpl-0", "model"), ('odd "id"\\', "org/model-é")]


def _reference(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


@pytest.mark.parametrize("request_id,model", IDS)
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish_reason", [None, "stop", "length"])
@pytest.mark.parametrize("token_ids", [None, [], [0, 7, 32767]])
def test_completion_events_are_the_model_s_json(request_id, model, text, finish_reason, token_ids):
    events = CompletionEvents(request_id, 1700000000, model)
    choice = CompletionChoice(text=text, finish_reason=finish_reason, token_ids=token_ids)
    expected = _reference(CompletionResponse(id=request_id, created=1700000000, model=model, choices=[choice]))
    assert events.event(text, finish_reason, token_ids) == expected
    assert json.loads(expected.removeprefix("data: "))["choices"][0]["text"] == text


@pytest.mark.parametrize("request_id,model", IDS)
@pytest.mark.parametrize("content", [None, *TEXTS])
@pytest.mark.parametrize("finish_reason", [None, "stop"])
def test_chat_events_are_the_model_s_json(request_id, model, content, finish_reason):
    events = ChatEvents(request_id, 42, model)
    choice = ChatChunkChoice(delta=Delta(content=content), finish_reason=finish_reason)
    expected = _reference(ChatCompletionChunk(id=request_id, created=42, model=model, choices=[choice]))
    assert events.event(content, finish_reason) == expected
