"""Argument types the commands share: each turns one flag's text into a value or an argparse error naming it."""
from __future__ import annotations

import argparse
import math


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
