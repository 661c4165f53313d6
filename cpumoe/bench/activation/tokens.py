"""The tokens a routing study (or a pruning calibration) runs: a text file's prompts, or random token ids.

    text file   one prompt per non-empty line, each tokenized by the checkpoint's tokenizer without special
                tokens; a line longer than max_len tokens is cut into chunks of max_len (each routed as a
                sequence of its own). To route a whole document, put it on one line, or keep its lines: every
                line is then its own short prompt.
    random      n ids drawn uniformly from [0, vocab) with a fixed seed, in sequences of max_len
Each sequence is routed as one prefill (no KV cache): the routing of a prompt's tokens is what a decode of that
text would see too, since a token's experts depend only on the tokens up to it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_LEN = 512


@dataclass(frozen=True, slots=True)
class TokenSet:
    name: str                    # the file's name, or "random"
    sequences: list[list[int]]   # each routed as one prefill

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def _chunks(ids: list[int], max_len: int) -> list[list[int]]:
    return [ids[i:i + max_len] for i in range(0, len(ids), max_len)]


def random_tokens(n: int, vocab: int, *, max_len: int = DEFAULT_MAX_LEN, seed: int = 0) -> TokenSet:
    if n < 1:
        raise ValueError(f"the number of random tokens must be positive, got {n}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g).tolist()
    return TokenSet("random", _chunks(ids, max_len))


def text_tokens(path: str | Path, model_path: str | Path, *, max_len: int = DEFAULT_MAX_LEN) -> TokenSet:
    """Every non-empty line of `path`, tokenized by the tokenizer of the checkpoint at `model_path`."""
    from cpumoe.engine.engine import load_tokenizer

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise ValueError(f"prompt file {path} is not UTF-8 text") from None
    if not lines:
        raise ValueError(f"prompt file {path} has no non-empty line")
    tokenizer = load_tokenizer(model_path)
    if tokenizer is None:
        raise ValueError(f"{model_path} has no tokenizer to read {path.name} with; use random tokens instead")
    sequences = []
    for line in lines:
        sequences += _chunks(tokenizer.encode(line, add_special_tokens=False), max_len)
    sequences = [s for s in sequences if s]
    if not sequences:
        raise ValueError(f"prompt file {path}: the tokenizer gives no tokens for any line")
    return TokenSet(path.name, sequences)


def token_set(model_path: str | Path, vocab: int, *, text: str | Path | None, random: int | None,
              max_len: int = DEFAULT_MAX_LEN) -> TokenSet:
    """The text file if given, else `random` random tokens."""
    if max_len < 1:
        raise ValueError(f"the maximum sequence length must be positive, got {max_len}")
    if text is not None:
        return text_tokens(text, model_path, max_len=max_len)
    if random is None:
        raise ValueError("give a text file or a number of random tokens")
    return random_tokens(random, vocab, max_len=max_len)
