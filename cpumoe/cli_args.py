"""What the commands share: argument types (each turns one flag's text into a value or an argparse error naming
it) and the console they print to."""
from __future__ import annotations

import argparse
import math

from rich.console import Console


def stdout_console() -> Console:
    """A console that wraps at the terminal's width, or at 160 columns when the output is a file or a pipe."""
    out = Console()
    return out if out.is_terminal else Console(width=160)


def names(text: str) -> list[str]:
    """A comma list, blanks dropped."""
    return [v.strip() for v in text.split(",") if v.strip()]


def unique_names(text: str) -> list[str]:
    """A comma list, blanks and repeats dropped, in order."""
    return list(dict.fromkeys(names(text)))


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma list of positive integers, at least one."""
    try:
        values = [int(v) for v in names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def weight_formats(text: str) -> list[str]:
    """A comma list of bf16/fp32/fp16 and quantized formats (aliases or full names), checked, in order."""
    from cpumoe.bench.layer import parse_weight_format
    formats = names(text)
    if not formats:
        raise argparse.ArgumentTypeError(f"expected comma-separated dtypes, got {text!r}")
    for name in formats:
        try:
            parse_weight_format(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return formats
