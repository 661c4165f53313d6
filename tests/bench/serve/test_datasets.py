"""Prompts: random ones of exact token lengths with a real tokenizer, JSONL files, and length ranges."""
import json
import random

import pytest

from cpumoe.bench.serve.datasets import LengthRange, Tokenizer, jsonl_prompts, random_prompt, random_prompts


@pytest.mark.parametrize("text,lo,hi", [("512", 512, 512), ("128:1024", 128, 1024), ("1", 1, 1), ("7:7", 7, 7)])
def test_length_range_parses(text, lo, hi):
    assert LengthRange.parse(text) == LengthRange(lo, hi) and str(LengthRange.parse(text)) == text.replace("7:7", "7")


@pytest.mark.parametrize("text,message", [("5:2", "empty"), ("0", "positive"), ("x", "integers"), ("1:2:3", "LO:HI"),
                                          ("-3:4", "positive")])
def test_length_range_refuses(text, message):
    with pytest.raises(ValueError, match=message):
        LengthRange.parse(text)


@pytest.mark.parametrize("path", ["dir", "file"])
def test_random_prompts_have_their_exact_lengths(tokenizer_dir, path):
    tokenizer = Tokenizer(tokenizer_dir if path == "dir" else tokenizer_dir / "tokenizer.json")
    rng = random.Random(0)
    for length in (1, 2, 5, 17, 129, 1000):
        text, n = random_prompt(tokenizer, length, rng)
        assert n == length and tokenizer.count(text) == length, length


def test_random_prompts_draw_ranges_and_are_seeded(tokenizer_dir):
    tokenizer = Tokenizer(tokenizer_dir)
    make = dict(num_prompts=40, input_len=LengthRange(5, 60), output_len=LengthRange(3, 9), endpoint="completions")
    prompts = random_prompts(tokenizer, seed=1, **make)
    assert prompts == random_prompts(tokenizer, seed=1, **make)
    assert {p.prompt_len for p in prompts} <= set(range(5, 61)) and len({p.prompt_len for p in prompts}) > 10
    assert all(p.prompt_len == p.asked_input_len == tokenizer.count(p.prompt) for p in prompts)
    assert {p.output_len for p in prompts} == set(range(3, 10))
    chat = random_prompts(tokenizer, seed=1, **{**make, "endpoint": "chat"})
    assert chat[0].prompt == [{"role": "user", "content": prompts[0].prompt}]


def test_random_prompts_avoid_special_tokens(tokenizer_dir):
    tokenizer = Tokenizer(tokenizer_dir)
    assert not {0, 1, 2} & set(tokenizer.ordinary_ids)   # <|endoftext|>, <|im_start|>, <|im_end|>
    text, _ = random_prompt(tokenizer, 500, random.Random(2))
    assert "<|" not in text


def test_tokenizer_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        Tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        Tokenizer(tmp_path / "tokenizer.json")


def test_jsonl_prompts(tmp_path, tokenizer_dir):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Return the value", "output_len": 4}) + "\n\n"
                    + json.dumps({"prompt": "of the function"}) + "\n")
    tokenizer = Tokenizer(tokenizer_dir)
    prompts = jsonl_prompts(path, tokenizer, num_prompts=5, output_len=LengthRange(9, 9), endpoint="completions",
                            seed=0)
    assert [p.prompt for p in prompts] == ["Return the value", "of the function"] * 2 + ["Return the value"]
    assert [p.output_len for p in prompts] == [4, 9, 4, 9, 4]
    assert prompts[0].prompt_len == tokenizer.count("Return the value")
    assert jsonl_prompts(path, None, num_prompts=1, output_len=LengthRange(9, 9), endpoint="completions",
                         seed=0)[0].prompt_len is None


def test_jsonl_chat_messages(tmp_path):
    path = tmp_path / "c.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path.write_text(json.dumps({"messages": messages}) + "\n")
    (prompt,) = jsonl_prompts(path, None, num_prompts=1, output_len=LengthRange(3, 3), endpoint="chat", seed=0)
    assert prompt.prompt == messages and prompt.output_len == 3


@pytest.mark.parametrize("line,endpoint,message", [
    ("{not json", "completions", "line 1: not JSON"),
    ("[1, 2]", "completions", "expected an object"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "completions", "use --endpoint chat"),
    ('{"prompt": "x"}', "chat", "use --endpoint completions"),
    ('{"prompt": 3}', "completions", "must be a string"),
    ('{"messages": []}', "chat", "non-empty list"),
    ('{"prompt": "x", "output_len": 0}', "completions", "output_len must be a positive integer"),
])
def test_jsonl_errors_name_the_line(tmp_path, line, endpoint, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        jsonl_prompts(path, None, num_prompts=1, output_len=LengthRange(3, 3), endpoint=endpoint, seed=0)


def test_empty_jsonl_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        jsonl_prompts(path, None, num_prompts=1, output_len=LengthRange(3, 3), endpoint="completions", seed=0)


def test_prompt_warnings_say_how_many_random_prompts_missed_their_length():
    from cpumoe.bench.serve.datasets import Prompt
    from cpumoe.bench.serve.run import prompt_warnings

    exact = Prompt(prompt="a", prompt_len=4, output_len=2, asked_input_len=4)
    off = Prompt(prompt="b", prompt_len=6, output_len=2, asked_input_len=4)
    assert prompt_warnings([exact, exact]) == []
    (warning,) = prompt_warnings([exact, off])
    assert warning.startswith("1 of 2 random prompts") and "6 tokens for 4" in warning


def test_each_rate_of_a_sweep_gets_prompts_of_its_own(tokenizer_dir):
    """A prefix cache filled by one rate must not answer the next: random prompts are drawn anew per rate."""
    from cpumoe.bench.serve.client import Target
    from cpumoe.bench.serve.run import ServeBench, make_prompts

    tokenizer = Tokenizer(tokenizer_dir)
    bench = ServeBench(target=Target("http://127.0.0.1:1", "m"), label="x", input_len=LengthRange(16, 16),
                       num_prompts=6, request_rates=(1.0, float("inf")), seed=3)
    first, second = make_prompts(bench, tokenizer, 0), make_prompts(bench, tokenizer, 1)
    assert first == make_prompts(bench, tokenizer, 0)   # seeded
    assert not {p.prompt for p in first} & {p.prompt for p in second}
    assert [p.prompt_len for p in second] == [16] * 6
