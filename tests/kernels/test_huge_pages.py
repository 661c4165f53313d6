"""Packed weights live on memory of their own, 2 MB-aligned and on transparent huge pages where Linux gives them
for the asking: a decode call streams hundreds of MB of them, and a stack placed in a reused heap chunk kept 4 KB
pages whatever the advice (seen on packed w2 stacks)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import cpumoe
from cpumoe import ops

HUGE = 2 << 20
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_on_request() -> bool:
    try:
        return re.search(r"\[(always|madvise)\]", THP_MODE.read_text()) is not None
    except OSError:
        return False


def huge_page_bytes(t: torch.Tensor) -> int:
    """Bytes of AnonHugePages in the mappings that overlap t's storage (from /proc/self/smaps)."""
    begin, end = t.data_ptr(), t.data_ptr() + t.nbytes
    overlaps, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            overlaps = int(m.group(1), 16) < end and int(m.group(2), 16) > begin
        elif overlaps and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def _layer(quant: str | None) -> cpumoe.FusedMoE:
    torch.manual_seed(0)
    E, H, I = 8, 1024, 512  # bf16: 8 x 3 MB; int4: 8 x 0.8 MB per stack
    w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16) * H**-0.5
    w2 = torch.randn(E, H, I, dtype=torch.bfloat16) * I**-0.5
    kw = {} if quant is None else {"quant": quant}
    return cpumoe.FusedMoE(w13, w2, top_k=2, **kw)


@pytest.mark.parametrize("quant", [None, "int4_w4a16", "int8_w8a8"])
def test_packed_stacks_are_huge_page_aligned(quant):
    layer = _layer(quant)
    if layer.backend == "naive":
        pytest.skip("the naive path keeps the checkpoint's tensors")
    for name in ("w13", "w2"):
        t = getattr(layer.prepared, name)
        assert t.data_ptr() % HUGE == 0, f"{name} starts {t.data_ptr() % HUGE} bytes past a 2 MB boundary"


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not _thp_on_request(),
                    reason="transparent huge pages are not given on request here")
@pytest.mark.parametrize("quant", [None, "int4_w4a16"])
def test_packed_stacks_sit_on_huge_pages(quant):
    layer = _layer(quant)
    if layer.backend == "naive":
        pytest.skip("the naive path keeps the checkpoint's tensors")
    for name in ("w13", "w2"):
        t = getattr(layer.prepared, name)
        whole_pages = t.nbytes // HUGE * HUGE
        assert huge_page_bytes(t) >= whole_pages, f"{name}: {huge_page_bytes(t)} of {t.nbytes} bytes on huge pages"


def test_empty_huge_frees_and_sizes():
    t = ops._C.empty_huge([3, 5, 7], torch.uint8)
    assert t.shape == (3, 5, 7) and t.dtype == torch.uint8 and t.data_ptr() % HUGE == 0
    t.fill_(1)
    assert int(t.sum()) == 105
    assert ops._C.empty_huge([0, 4], torch.float32).shape == (0, 4)
