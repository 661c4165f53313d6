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


def packed_stacks(quant: str | None) -> dict[str, torch.Tensor]:
    """w13 and w2 of a layer as its native backend packs them."""
    torch.manual_seed(0)
    E, H, I = 8, 1024, 512  # bf16: 8 x 3 MB; int4: 8 x 0.8 MB per stack
    w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16) * H**-0.5
    w2 = torch.randn(E, H, I, dtype=torch.bfloat16) * I**-0.5
    kw = {} if quant is None else {"quant": quant}
    layer = cpumoe.FusedMoE(w13, w2, top_k=2, **kw)
    if layer.backend == "naive":
        pytest.skip("the naive backend keeps the checkpoint's tensors")
    return {"w13": layer.prepared.w13, "w2": layer.prepared.w2}


@pytest.mark.parametrize("quant", [None, "int4_w4a16", "int8_w8a8"])
def test_packed_stacks_are_huge_page_aligned(quant):
    for name, t in packed_stacks(quant).items():
        assert t.data_ptr() % HUGE == 0, f"{name} starts {t.data_ptr() % HUGE} bytes past a 2 MB boundary"


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not _thp_on_request(),
                    reason="transparent huge pages are not given on request here")
@pytest.mark.parametrize("quant", [None, "int4_w4a16"])
def test_packed_stacks_sit_on_huge_pages(quant):
    for name, t in packed_stacks(quant).items():
        whole_pages = t.nbytes // HUGE * HUGE
        assert huge_page_bytes(t) >= whole_pages, f"{name}: {huge_page_bytes(t)} of {t.nbytes} bytes on huge pages"


def test_empty_packed_stack_keeps_the_record():
    """Packing expert by expert into a stack gives the stack the experts' record, so the op takes it."""
    torch.manual_seed(0)
    w13, w2 = torch.randn(2, 64, 64), torch.randn(2, 64, 32)
    one13, one2 = ops.pack_w13(w13[:1].contiguous(), "generic"), ops.pack_w2(w2[:1].contiguous(), "generic")
    stack13, stack2 = ops._C.empty_packed_stack(one13, 2), ops._C.empty_packed_stack(one2, 2)
    assert stack13.shape == (2, *one13.shape[1:]) and stack13.data_ptr() % HUGE == 0
    for e in range(2):
        stack13[e].copy_(ops.pack_w13(w13[e:e + 1].contiguous(), "generic")[0])
        stack2[e].copy_(ops.pack_w2(w2[e:e + 1].contiguous(), "generic")[0])
    x, tw, ti = torch.randn(3, 64), torch.full((3, 2), 0.5), torch.tensor([[0, 1]] * 3, dtype=torch.int32)
    whole = (ops.pack_w13(w13, "generic"), ops.pack_w2(w2, "generic"))
    torch.testing.assert_close(ops.fused_experts(x, stack13, stack2, tw, ti, backend="generic"),
                               ops.fused_experts(x, *whole, tw, ti, backend="generic"))
    with pytest.raises(ValueError, match="like is not a weight packed by cpumoe"):
        ops._C.empty_packed_stack(one13.clone(), 2)


def test_zeros_on_huge_pages_are_zeros_of_the_shape_asked():
    t = ops.zeros_on_huge_pages((3, 16, 4, 40), torch.bfloat16)
    assert t.shape == (3, 16, 4, 40) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE == 0 and not t.any()
    t.fill_(1.5)  # writable, and freed on its own (no record to keep)
    assert ops.zeros_on_huge_pages((2, 16, 1, 0), torch.float32).shape == (2, 16, 1, 0)  # MLA's V: no channels
