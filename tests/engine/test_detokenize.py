"""IncrementalDetokenizer: streamed text equals the full decode, never a split character; stop strings."""
from __future__ import annotations

import random

import pytest

from cpumoe.engine.detokenize import IncrementalDetokenizer
from cpumoe.synthetic.tokenizer import EOS, make_tokenizer

TEXTS = [
    "héllo 世界 🙂 naïve café",
    "plain ascii text, with spaces  and\nnewlines",
    "🙂🙂 émoji at the start, 世界 at the end 世界",
    "  leading spaces and a trailing one ",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(path, 1000)
    return path


@pytest.fixture(scope="module", params=["transformers", "tokenizers"])
def tokenizer(request, tokenizer_dir):
    if request.param == "transformers":
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def encode(tokenizer, text: str) -> list[int]:
    encoded = tokenizer.encode(text)
    return encoded if isinstance(encoded, list) else encoded.ids     # transformers | tokenizers


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[tuple[str, bool]]:
    return [detok.add(i) for i in ids]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
@pytest.mark.parametrize("prompt", ["", "A prompt ending in 世界"], ids=["no_prompt", "prompt"])
def test_stream_equals_full_decode(tokenizer, text, prompt):
    prompt_ids, ids = encode(tokenizer, prompt), encode(tokenizer, text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) or text.isascii()   # the text splits characters
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = stream(detok, ids)
    assert all("\ufffd" not in piece for piece, _ in pieces), pieces
    assert not any(hit for _, hit in pieces)
    assert detok.finish() == ""                        # nothing held back without stop strings
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(piece for piece, _ in pieces) == expected == text
    assert detok.text == expected


def test_emits_as_soon_as_a_character_completes(tokenizer):
    ids = encode(tokenizer, "héllo 世界")
    detok = IncrementalDetokenizer(tokenizer, [])
    for n, token_id in enumerate(ids, 1):
        detok.add(token_id)
        full = tokenizer.decode(ids[:n])
        assert detok.text == full.rstrip("\ufffd"), n   # everything but the unfinished character


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.token_to_id(EOS) if hasattr(tokenizer, "token_to_id") else tokenizer.convert_tokens_to_ids(EOS)
    detok = IncrementalDetokenizer(tokenizer, [])
    text = "".join(detok.add(i)[0] for i in encode(tokenizer, "done") + [eos])
    assert text + detok.finish() == "done"


def test_prompt_context_does_not_leak(tokenizer):
    prompt_ids = encode(tokenizer, "The prompt says: hello")
    ids = encode(tokenizer, " and then some")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [piece for piece, _ in stream(detok, ids)]
    assert "".join(pieces) + detok.finish() == " and then some"   # the leading space survives, no prompt text
    assert pieces[0].startswith(" ")


def stop_run(tokenizer, text: str, stop: list[str]):
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=stop)
    pieces, emitted = [], ""
    for i in ids:
        piece, hit = detok.add(i)
        emitted += piece
        pieces.append((piece, hit))
        if hit:
            break
    return detok, pieces, emitted


@pytest.mark.parametrize("text, stop, before", [
    ("naïve café, 世界 and more", ["é, 世"], "naïve caf"),           # a stop string over several tokens
    ("the quick brown fox", ["k br"], "the quic"),
    ("STOP right there", ["STOP"], ""),                                # at the very start
    ("aaa stop1 bbb stop2", ["stop2", "stop1"], "aaa "),               # the earliest stop string wins
], ids=["multibyte", "ascii", "at_start", "earliest"])
def test_stop_string(tokenizer, text, stop, before):
    ids = encode(tokenizer, text)
    assert len(ids) > 1
    detok, pieces, emitted = stop_run(tokenizer, text, stop)
    assert pieces[-1][1] is True and not any(hit for _, hit in pieces[:-1])
    assert emitted == before == detok.text
    # Nothing of the stop string was ever emitted, not even a partial start of it.
    running = ""
    for piece, _ in pieces:
        running += piece
        assert before.startswith(running), running
    assert detok.add(ids[-1]) == ("", True)            # stopped: nothing more
    assert detok.finish() == ""


def test_stop_string_split_across_tokens_is_held_back(tokenizer):
    """The stop string spans tokens; its first part stays unemitted until the match is decided."""
    text, stop = "hello world", ["lo wor"]
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=stop)
    for i in ids:
        piece, hit = detok.add(i)
        assert "lo" not in detok.text
        if hit:
            break
    assert hit and detok.text == "hel"


def test_finish_flushes_a_held_back_tail(tokenizer):
    ids = encode(tokenizer, "hello wor")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["world"])
    pieces = stream(detok, ids)
    assert not any(hit for _, hit in pieces)
    assert "".join(piece for piece, _ in pieces) == "hello "       # "wor" could start "world"
    assert detok.finish() == "wor"
    assert detok.text == "hello wor"


def test_finish_flushes_an_unfinished_character(tokenizer):
    ids = encode(tokenizer, "ab世")
    # Drop the last token(s) until the decode ends inside the character.
    while not tokenizer.decode(ids).endswith("\ufffd"):
        assert len(ids) > 1, "the tokenizer keeps 世 in one token"
        ids = ids[:-1]
    detok = IncrementalDetokenizer(tokenizer, [])
    emitted = "".join(piece for piece, _ in stream(detok, ids))
    assert "\ufffd" not in emitted
    assert emitted + detok.finish() == tokenizer.decode(ids)        # at the end, as the full decode has it


def test_stop_strings_against_a_reference(tokenizer):
    """Random stop strings (substrings of the text, some multi-byte): the stream stops at the first token whose
    text contains a stop string and emits exactly the text before the earliest one, never more on the way."""
    rng = random.Random(0)
    for case in range(200):
        text = TEXTS[case % len(TEXTS)]
        ids = encode(tokenizer, text)
        stop = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(text))
            stop.append(text[start:start + rng.randint(1, 6)])
        expected = None
        for n in range(1, len(ids) + 1):             # reference: decode every prefix of the ids
            prefix_text = tokenizer.decode(ids[:n])
            found = [i for i in (prefix_text.find(s) for s in stop) if i >= 0]
            if found:
                expected = prefix_text[:min(found)]
                break
        assert expected is not None                  # every stop string is in the text
        detok = IncrementalDetokenizer(tokenizer, [], stop=stop)
        for token_id in ids:
            _, hit = detok.add(token_id)
            assert expected.startswith(detok.text), (text, stop, detok.text)
            if hit:
                break
        assert hit and detok.text == expected, (text, stop, detok.text, expected)


def test_fast_tokenizer_decodes_by_its_backend_as_transformers_does(tokenizer_dir):
    from transformers import AutoTokenizer

    from cpumoe.engine.detokenize import _decode_fn, _decodes_by_backend
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert _decodes_by_backend(hf)
    decode, rng = _decode_fn(hf), random.Random(0)
    windows = [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 9))] for _ in range(500)]
    windows.append([hf.convert_tokens_to_ids(EOS), *encode(hf, " a .b ,c"), hf.convert_tokens_to_ids(EOS)])
    for ids in windows:
        assert decode(ids) == hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), ids


def test_a_tokenizer_with_its_own_decode_is_called_through_it(tokenizer_dir):
    from transformers import AutoTokenizer

    from cpumoe.engine.detokenize import _decode_fn, _decodes_by_backend
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)

    class Shouting(type(hf)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    hf.__class__ = Shouting
    assert not _decodes_by_backend(hf)
    ids = encode(hf, "quiet words")
    assert _decode_fn(hf)(ids) == "QUIET WORDS"
