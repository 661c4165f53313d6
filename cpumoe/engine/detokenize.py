"""Streaming detokenization with stop strings: one generated token id in, the text that is safe to emit out.

    token id -> decode(window) - decode(prefix)  (waits while the text ends in U+FFFD: a split UTF-8 character)
             -> pending text -> stop string found: emit the text before it, stop
                             -> else emit all but the longest tail that could start a stop string

The prefix window (vLLM's and TGI's scheme) decodes a few tokens of context before the new ones, so a tokenizer
that drops or adds a leading space, or merges across tokens, comes out exactly as decoding the whole sequence
would, and each step decodes a handful of tokens rather than everything generated so far.

Limitation: a prompt that ends inside a UTF-8 character leaves its first bytes in the prefix; the character's
completion in the generated text then comes out as replacement characters (vLLM behaves the same).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

# Tokens of the prompt decoded as context before the first generated token (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def _decode_fn(tokenizer) -> Callable[[list[int]], str]:
    """decode(ids) for a transformers tokenizer or a `tokenizers.Tokenizer`, special tokens skipped."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # tokenizers is a dependency of transformers; a plain-python tokenizer may still work
        Tokenizer = None
    if Tokenizer is not None and isinstance(tokenizer, Tokenizer):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if Tokenizer is not None and isinstance(backend, Tokenizer) and _decodes_by_backend(tokenizer):
        # transformers' own decode of a fast tokenizer is this call wrapped in ~3 us of Python a call, two calls a
        # token; right after a decode step has streamed its weights that wrapping cost ~50 us a token here.
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    # Cleaning up spaces (" ." -> ".") would depend on where a window starts; streaming must not do it.
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _decodes_by_backend(tokenizer) -> bool:
    """Whether tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) is its backend
    `tokenizers.Tokenizer`'s decode(ids, skip_special_tokens=True): transformers' fast tokenizers (TokenizersBackend,
    PreTrainedTokenizerFast before it) where no class overrides decode or _decode."""
    cls = type(tokenizer)
    return (getattr(cls.decode, "__qualname__", "") == "PreTrainedTokenizerBase.decode"
            and getattr(cls._decode, "__qualname__", "") in ("TokenizersBackend._decode",
                                                               "PreTrainedTokenizerFast._decode"))


class IncrementalDetokenizer:
    """One per request. `add` each generated token; `finish` once at the end (unless a stop string was hit)."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._decode = _decode_fn(tokenizer)
        self._ids: list[int] = list(prompt_token_ids)
        self._read_offset = len(self._ids)                 # ids before it have been turned into text
        self._prefix_offset = max(len(self._ids) - PROMPT_CONTEXT_TOKENS, 0)   # the window's context starts here
        self._stop = [s for s in stop if s]                # an empty stop string would stop at once
        self._pending = ""        # decoded text not emitted yet: a tail that could be the start of a stop string
        self._chunks: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """All the text emitted so far."""
        return "".join(self._chunks)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Returns (the new text safe to emit now, whether a stop string was hit). Once stopped, returns ("", True)."""
        if self.stopped:
            return "", True
        self._ids.append(int(token_id))
        self._pending += self._decode_new(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush what is still held back (a possible start of a stop string, undecodable trailing bytes) at the end
        of generation. After it, `text` equals the decode of all generated ids (up to a stop string, if any)."""
        if self.stopped:
            return ""
        self._pending += self._decode_new(final=True)
        text, _ = self._release(final=True)
        return text

    def _decode_new(self, *, final: bool) -> str:
        """The text the ids after the read offset add to the window; "" while it ends in a split character."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""             # nothing new yet (a special token, or bytes of an unfinished character)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    def _release(self, *, final: bool) -> tuple[str, bool]:
        """Move the safe part of the pending text to the output; stop at the earliest stop string."""
        pending = self._pending
        hits = [i for i in (pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            emit, self._pending, self.stopped = pending[:min(hits)], "", True
        else:
            # Invariant: the held tail is the longest suffix of all generated text that is a proper prefix of a
            # stop string, so a stop string never starts in text already emitted and searching `pending` suffices.
            hold = 0 if final else self._stop_prefix_len(pending)
            emit, self._pending = pending[:len(pending) - hold], pending[len(pending) - hold:]
        if emit:
            self._chunks.append(emit)
        return emit, self.stopped

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
