"""Does a case fit this machine? Checked before a case runs, so a point too large is recorded as "oom", never run
into the kernel's OOM killer.

    budget = MemAvailable (/proc/meminfo) x (1 - MARGIN) - RESERVE, or a cap given by the user if lower

What a case needs is an estimate from its shape (no allocation):
    layer: the random weights in their float dtype (the layer bench keeps them while it packs), a quantized copy
           (a byte per code plus scales) for quantized formats, the backend's packed copy (cpumoe.bench.layer's own
           case_nbytes), the quantizers' float32 temporaries, the input pool and a token's intermediate
           activations, the bandwidth probe's buffer and, from MM_FROM_TOKENS on, the side-by-side GEMM's operands
    model: the weights as loaded (the checkpoint's bytes, scaled to --dtype; the loader packs expert by expert, so
           no second copy of a layer), the KV cache the engine reserves, the probe and GEMM buffers, and, for a
           synthetic checkpoint, its largest shard while it is written (and its files when the temporary
           directory is in memory: tmpfs)
    both:  PROCESS_BYTES for the interpreter, torch and the engine's own state
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

MARGIN = 0.10               # of MemAvailable kept free: the page cache others need, estimates that run short
RESERVE = 512 << 20         # and this much more
PROCESS_BYTES = 768 << 20   # a Python process with torch and cpumoe loaded, before any weights


def available_memory() -> int:
    """MemAvailable of /proc/meminfo, bytes (ValueError where it is missing: no silent guess)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError as e:
        raise ValueError(f"cannot read /proc/meminfo: {e}") from None
    raise ValueError("/proc/meminfo has no MemAvailable line")


@dataclass(frozen=True, slots=True)
class MemoryPolicy:
    """How much a case may use: MemAvailable less the margin, or `limit_bytes` if that is lower (a cap given with
    --max-memory-gb, or a test's). `available` reads the machine's available memory (injectable)."""
    limit_bytes: int | None = None
    available: Callable[[], int] = available_memory

    def budget(self) -> tuple[int, int]:
        """(bytes a case may use, bytes available as read)."""
        free = self.available()
        budget = int(free * (1 - MARGIN)) - RESERVE
        if self.limit_bytes is not None:
            budget = min(budget, self.limit_bytes)
        return max(budget, 0), free


def is_tmpfs(path: str) -> bool:
    """Whether `path` lies on a file system held in memory (its files count against memory)."""
    path = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) > len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        return False
    return fstype in ("tmpfs", "ramfs")
