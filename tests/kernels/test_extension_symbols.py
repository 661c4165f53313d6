"""The extension's ISA units keep their tiles to themselves.

Each x86/Arm unit instantiates shared templates (quant_tiles.h) on types from its own unnamed namespace.
GCC mangles every unit's unnamed namespace alike, so an instantiation emitted as a weak or unique symbol
is merged by the linker across units: one ISA's dispatch table then serves another backend's name, and the
grid tests cannot see it (every backend is bit-identical to the generic one). No such symbol may exist.
"""

import platform
import shutil
import subprocess

import pytest

import cpumoe._C as extension


@pytest.mark.skipif(shutil.which("nm") is None, reason="binutils' nm is not installed")
def test_no_unnamed_namespace_symbol_is_shared_between_units():
    listing = subprocess.run(["nm", extension.__file__], capture_output=True, text=True, check=True).stdout
    shared = [
        line for line in listing.splitlines()
        if "_GLOBAL__N" in line and len(line.split()) == 3 and line.split()[1] in ("W", "V", "u", "w", "v")
    ]
    assert not shared, "symbols from unnamed namespaces merged across units:\n" + "\n".join(shared[:10])


_RELEASE_CHECK = """
import torch
from cpumoe import ops

def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

ops.release_free_memory()
# 64 KB buffers (below glibc's mmap threshold, so on the heap), each followed by a small live one: once freed
# they are holes free() cannot give back; only a trim can.
buffers, pins = [], []
for _ in range(1600):  # ~100 MB
    buffers.append(torch.ones(1 << 14))
    pins.append(torch.ones(16))
del buffers
before = rss_kb()
assert isinstance(ops.release_free_memory(), bool)
after = rss_kb()
assert after < before - 50_000, f"malloc_trim returned less than half of 100 MB of freed heap: {before} -> {after} KB"
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_free_memory_hands_a_freed_buffer_back():
    """The loader's malloc_trim between phases: a freed heap buffer leaves the resident set. In a fresh process, so
    that what earlier tests left in this one's heap cannot change how much there is to trim."""
    import sys

    done = subprocess.run([sys.executable, "-c", _RELEASE_CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
