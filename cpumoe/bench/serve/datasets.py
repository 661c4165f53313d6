"""The prompts of a serving benchmark: random token prompts of asked lengths, or a JSONL file.

Random prompts: for each request, draw the asked number of token ids uniformly from the tokenizer's vocabulary
(special tokens, and tokens that are only part of a character, left out), decode them to text and encode the text
again. Decoding then encoding does not give back the same ids (a byte-level BPE merges neighbours, a SentencePiece
one splits differently), so the ids are adjusted and the round trip repeated: too many tokens, cut to the asked
length; too few, top up with fresh random ids. Up to `ROUND_TRIPS` rounds. A prompt's `prompt_len` is always the
exact count of its final text under this tokenizer (without special tokens), and equals the asked length unless the
rounds ran out (the report then says how many did; with the synthetic byte-level BPE tokenizers, 140 prompts of 1
to 1,024 tokens were all exact). The server counts the prompt with its own template (chat roles, a BOS token), so
its `prompt_tokens` can be larger by those; a chat prompt's length here counts the message contents only.

JSONL: one object per line with "prompt" (a string, for --endpoint completions) or "messages" (an OpenAI chat
message list, for --endpoint chat) and an optional "output_len"; the first of `num_prompts` lines are used, and
a file with fewer lines is cycled.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROUND_TRIPS = 16     # decode/encode rounds a random prompt gets to reach its exact length


@dataclass(frozen=True, slots=True)
class LengthRange:
    """A token length: `lo` == `hi` for a fixed one, else drawn uniformly from lo..hi (both included)."""
    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """"512" or "128:1024"."""
        parts = text.split(":")
        if len(parts) not in (1, 2):
            raise ValueError(f"expected N or LO:HI, got {text!r}")
        try:
            lo, hi = int(parts[0]), int(parts[-1])
        except ValueError:
            raise ValueError(f"expected N or LO:HI with integers, got {text!r}") from None
        if lo < 1:
            raise ValueError(f"lengths must be positive, got {text!r}")
        if hi < lo:
            raise ValueError(f"the range {text!r} is empty: {lo} > {hi}")
        return cls(lo, hi)

    def draw(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's input. `prompt` is a string (completions) or a message list (chat)."""
    prompt: str | list[dict[str, Any]]
    prompt_len: int | None      # tokens, by the client's tokenizer (None: no tokenizer; the server's usage tells)
    output_len: int
    asked_input_len: int | None = None   # random prompts: the length asked for


class Tokenizer:
    """The few things a benchmark needs of a tokenizer, over `tokenizers` or `transformers`."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path if path.is_file() else path / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"tokenizer {path}: no such file or directory")
        self.name = str(path)
        if file.is_file():
            from tokenizers import Tokenizer as Fast
            try:
                self._fast = Fast.from_file(str(file))
            except Exception as e:  # the library raises a bare Exception on a bad file
                raise ValueError(f"tokenizer {file}: cannot load it: {e}") from None
            self._hf = None
            specials = {t.content for t in self._fast.get_added_tokens_decoder().values() if t.special}
            vocab = self._fast.get_vocab(with_added_tokens=True)
        else:
            import transformers
            try:
                self._hf = transformers.AutoTokenizer.from_pretrained(str(path))
            except (OSError, ValueError) as e:
                raise ValueError(f"tokenizer {path}: cannot load it: {e}") from None
            self._fast = None
            specials = set(self._hf.all_special_tokens)
            vocab = self._hf.get_vocab()
        # ids to draw random prompts from: every ordinary token that decodes to whole characters on its own (a lone
        # byte of a multi-byte character decodes to U+FFFD, which encodes back to other, more tokens)
        ids = sorted(i for t, i in vocab.items() if t not in specials)
        texts = (self._fast.decode_batch([[i] for i in ids]) if self._fast is not None
                 else self._hf.batch_decode([[i] for i in ids]))
        self.ordinary_ids = [i for i, text in zip(ids, texts) if text and "\ufffd" not in text]
        if not self.ordinary_ids:
            raise ValueError(f"tokenizer {path}: its vocabulary has no ordinary tokens")

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=True)
        return self._hf.decode(ids, skip_special_tokens=True)

    def count(self, text: str) -> int:
        return len(self.encode(text))


def random_prompt(tokenizer: Tokenizer, length: int, rng: random.Random) -> tuple[str, int]:
    """A text of `length` tokens under `tokenizer` (see the module docstring); returns it and its exact count."""
    ids = rng.choices(tokenizer.ordinary_ids, k=length)
    text = tokenizer.decode(ids)
    for _ in range(ROUND_TRIPS):
        got = tokenizer.encode(text)
        if len(got) == length:
            return text, length
        ids = got[:length] if len(got) > length else got + rng.choices(tokenizer.ordinary_ids, k=length - len(got))
        text = tokenizer.decode(ids)
    return text, tokenizer.count(text)


def random_prompts(tokenizer: Tokenizer, *, num_prompts: int, input_len: LengthRange, output_len: LengthRange,
                   endpoint: str, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        asked, out = input_len.draw(rng), output_len.draw(rng)
        text, n = random_prompt(tokenizer, asked, rng)
        body: str | list[dict[str, Any]] = text if endpoint == "completions" else [{"role": "user", "content": text}]
        prompts.append(Prompt(prompt=body, prompt_len=n, output_len=out, asked_input_len=asked))
    return prompts


def jsonl_prompts(path: str | Path, tokenizer: Tokenizer | None, *, num_prompts: int, output_len: LengthRange,
                  endpoint: str, seed: int) -> list[Prompt]:
    """The prompts of a JSONL file (see the module docstring); `output_len` where a line gives none."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--dataset {path}: cannot read it: {e}") from None
    key = "prompt" if endpoint == "completions" else "messages"
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--dataset {path}, line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON: {e}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
        rows.append((where, row))
    if not rows:
        raise ValueError(f"--dataset {path}: no prompts in it")

    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        where, row = rows[i % len(rows)]
        prompt = _prompt_of(row, key, endpoint, where)
        out = row.get("output_len", None)
        if out is None:
            out = output_len.draw(rng)
        elif not isinstance(out, int) or isinstance(out, bool) or out < 1:
            raise ValueError(f"{where}: output_len must be a positive integer, got {out!r}")
        n = None
        if tokenizer is not None:
            n = tokenizer.count(prompt) if isinstance(prompt, str) else sum(
                tokenizer.count(m["content"]) for m in prompt)
        prompts.append(Prompt(prompt=prompt, prompt_len=n, output_len=out))
    return prompts


def _prompt_of(row: dict, key: str, endpoint: str, where: str) -> str | list[dict[str, Any]]:
    if key not in row:
        other = "messages" if key == "prompt" else "prompt"
        fix = "chat" if key == "prompt" else "completions"
        hint = f" (it has {other!r}: use --endpoint {fix})" if other in row else ""
        raise ValueError(f"{where}: --endpoint {endpoint} needs a {key!r} field{hint}")
    value = row[key]
    if key == "prompt":
        if not isinstance(value, str):
            raise ValueError(f"{where}: 'prompt' must be a string, got {type(value).__name__}")
        return value
    if (not isinstance(value, list) or not value
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in value)):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\": str, \"content\": str}}")
    return value
