"""How a checkpoint written by cpumoe (make-model, quantize, prune) is cut into safetensors files and named, as the
Hugging Face hub names them: one `model.safetensors`, or `model-00001-of-0000N.safetensors` beside an index."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from cpumoe.loader.checkpoint import SINGLE

T = TypeVar("T")


def split_into_shards(items: Sequence[T], nbytes: Callable[[T], int], max_bytes: int) -> list[list[T]]:
    """Consecutive items in shards of at most `max_bytes` each (an item larger than that gets a shard alone)."""
    shards: list[list[T]] = [[]]
    size = 0
    for item in items:
        n = nbytes(item)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    return shards


def shard_names(count: int, *, single_file: bool = True) -> list[str]:
    """The files of `count` shards; one shard is `model.safetensors` unless single_file is False."""
    if count == 1 and single_file:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
