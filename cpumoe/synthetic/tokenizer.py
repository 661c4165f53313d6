"""A byte-level BPE tokenizer trained here, in seconds, on text this machine already has (the docstrings of
Python's standard library): no download, and the same corpus gives the same tokenizer every time.

Special tokens follow Qwen's ChatML: `<|endoftext|>` (bos/pad) and `<|im_start|>`/`<|im_end|>` (eos, the end of a
turn). They take ids 0, 1, 2; the trained merges follow. Files written, as on the hub:

    tokenizer.json          the `tokenizers` model (https://huggingface.co/docs/tokenizers)
    tokenizer_config.json   class, special tokens and model_max_length for transformers.AutoTokenizer
    chat_template.jinja     the ChatML chat template
"""
from __future__ import annotations

import functools
import importlib
import inspect
import json
import warnings
from pathlib import Path

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
BOS, EOS, PAD = ENDOFTEXT, IM_END, ENDOFTEXT
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)   # the byte alphabet and the special tokens

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Modules whose docstrings make the corpus (about 1 MB): a fixed list, so the corpus does not depend on what else
# happens to be imported.
CORPUS_MODULES = (
    "builtins", "os", "os.path", "sys", "re", "json", "collections", "itertools", "functools", "string", "textwrap",
    "argparse", "pathlib", "typing", "dataclasses", "datetime", "decimal", "fractions", "math", "statistics",
    "random", "heapq", "bisect", "array", "struct", "codecs", "io", "shutil", "tempfile", "glob", "fnmatch",
    "csv", "configparser", "logging", "threading", "subprocess", "socket", "email", "http.client", "urllib.parse",
    "unittest", "doctest", "inspect", "ast", "enum", "abc", "contextlib", "operator", "copy", "pprint", "difflib",
    "zipfile", "tarfile", "gzip", "hashlib", "base64", "uuid", "calendar", "locale", "gettext", "asyncio",
)


@functools.cache
def corpus() -> str:
    """The docstrings of CORPUS_MODULES and their public members, in a fixed order."""
    docs: list[str] = []
    with warnings.catch_warnings():   # typing.io and typing.re warn when read
        warnings.simplefilter("ignore", DeprecationWarning)
        for module_name in CORPUS_MODULES:
            module = importlib.import_module(module_name)
            docs.append(inspect.getdoc(module) or "")
            for name, member in sorted(vars(module).items()):
                if not name.startswith("_") and (inspect.isclass(member) or inspect.isroutine(member)):
                    docs.append(f"{module_name}.{name}\n{inspect.getdoc(member) or ''}")
    return "\n\n".join(dict.fromkeys(d for d in docs if d.strip()))   # drop repeated docstrings, keep order


def make_tokenizer(out_dir, vocab_size: int, *, seed: int = 0, model_max_length: int = 32768):
    """Train a byte-level BPE of at most `vocab_size` tokens (fewer when the corpus runs out of merges) and write
    it to `out_dir`. Returns the `tokenizers.Tokenizer`. Training is deterministic; `seed` is accepted for a
    uniform signature and does not change the result."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is below {MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} specials)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus().split("\n\n"), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return tokenizer
