"""What this process's memory sits on, read from /proc and /sys: its resident size, and how much of the memory that
asked for transparent huge pages (the packed weights: csrc/core/memory.cpp's map_huge) got them.

A weight stream read through 4 KB pages takes a TLB miss every 4 KB where 2 MB pages take one every 2 MB, so the
packed weights' share on huge pages moves decode speed. The kernel hands out a 2 MB page only where it finds (or
can compact) 2 MB of free, contiguous memory; where it cannot, it falls back to 4 KB pages without a word, so this
module is how the loader finds out and says so."""
from __future__ import annotations

import bisect
import re

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HUGE_PAGE_BYTES = 2 << 20
# Below this share on 2 MB pages, decode is measurably slower (the last-loaded of seven checkpoints got 45-71%, and
# its decode speed-up fell with it).
HUGE_PAGES_WANTED = 0.9
_THP = Path("/sys/kernel/mm/transparent_hugepage")


def proc_gb(path: str, key: str) -> float | None:
    """A "key: N kB" line of a /proc file of this process, in GB (None where the kernel does not give it)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def current_rss_gb() -> float:
    """Resident memory now (GB)."""
    return proc_gb("/proc/self/status", "VmRSS") or 0.0


@dataclass(frozen=True)
class HugePageUse:
    """Resident memory that asked for huge pages (madvise), and how much of it is on them (GB)."""
    advised_gb: float
    huge_gb: float

    @property
    def share(self) -> float | None:
        """The part on 2 MB pages (None when nothing asked)."""
        return min(self.huge_gb / self.advised_gb, 1.0) if self.advised_gb > 0 else None


_VMA_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def advised_memory(regions: Sequence[tuple[int, int]]) -> HugePageUse:
    """The resident size and AnonHugePages of the address ranges `regions` ([(address, bytes)]:
    cpumoe.ops.huge_mappings_since), from this process's mappings flagged for huge pages ("hg" in /proc/self/smaps'
    VmFlags). The kernel merges neighbouring mappings of the same kind into one, so a range's part of a merged
    mapping's figures is taken in proportion to its bytes. Zero where the kernel gives no smaps."""
    spans = sorted((begin, begin + size) for begin, size in regions)
    advised = huge = 0.0
    start = end = rss = anon_huge = 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if m := _VMA_HEADER.match(line):
                    start, end = int(m.group(1), 16), int(m.group(2), 16)
                    rss = anon_huge = 0
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("AnonHugePages:"):
                    anon_huge = int(line.split()[1])
                elif line.startswith("VmFlags:") and "hg" in line.split()[1:]:
                    part = _overlap(spans, start, end) / (end - start)
                    advised += rss * part
                    huge += anon_huge * part
    except OSError:
        pass
    return HugePageUse(advised * 1024 / 1e9, huge * 1024 / 1e9)


def _overlap(spans: list[tuple[int, int]], start: int, end: int) -> int:
    """Bytes of [start, end) inside the sorted, disjoint spans."""
    i = bisect.bisect_right(spans, (start, start)) - 1
    total = 0
    for begin, stop in spans[max(i, 0):]:
        if begin >= end:
            break
        total += max(0, min(stop, end) - max(begin, start))
    return total


def transparent_huge_pages() -> dict[str, str]:
    """The kernel's transparent huge page settings that decide whether an madvise is honoured: {"enabled": "madvise",
    "defrag": "madvise"} (the bracketed choice of each file; absent where the kernel has none)."""
    settings = {}
    for name in ("enabled", "defrag"):
        try:
            text = (_THP / name).read_text()
        except OSError:
            continue
        if m := re.search(r"\[(\w[\w+]*)\]", text):
            settings[name] = m.group(1)
    return settings


def free_huge_blocks_gb(buddyinfo: str | None = None) -> float | None:
    """Free memory in blocks of 2 MB or more (/proc/buddyinfo's text, read now if not given: orders 9 and up): what
    the kernel can hand out as huge pages without compacting. None where the kernel does not say."""
    if buddyinfo is None:
        try:
            buddyinfo = Path("/proc/buddyinfo").read_text()
        except OSError:
            return None
    order = (HUGE_PAGE_BYTES // 4096).bit_length() - 1
    free = 0
    for line in buddyinfo.splitlines():
        counts = line.split()[4:]  # "Node 0, zone Normal", then the free blocks of each order from 4 KB up
        free += sum(int(n) << k for k, n in enumerate(counts) if k >= order)
    return free * 4096 / 1e9


def huge_page_advice() -> str:
    """Why memory that asked for huge pages may not get them here, in a sentence (for a log line or `cpumoe info`)."""
    thp = transparent_huge_pages()
    if not thp:
        return "this kernel has no transparent huge pages"
    if thp.get("enabled") == "never":
        return "transparent huge pages are off (/sys/kernel/mm/transparent_hugepage/enabled: never)"
    free = free_huge_blocks_gb()
    free_text = f"{free:.1f} GB free in 2 MB blocks now" if free is not None else "free 2 MB blocks unknown"
    return f"transparent huge pages enabled={thp.get('enabled', '?')}, defrag={thp.get('defrag', '?')}; {free_text}"
