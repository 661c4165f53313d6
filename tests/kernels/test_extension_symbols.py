"""The extension's ISA units keep their tiles to themselves.

Each x86/Arm unit instantiates shared templates (quant_tiles.h) on types from its own unnamed namespace.
GCC mangles every unit's unnamed namespace alike, so an instantiation emitted as a weak or unique symbol
is merged by the linker across units: one ISA's dispatch table then serves another path's name, and the
grid tests cannot see it (every path is bit-identical to the generic one). No such symbol may exist.
"""

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
