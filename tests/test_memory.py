"""What the process's memory sits on (cpumoe.memory), and the loader's word on the packed weights' huge pages."""
import logging
from pathlib import Path

import pytest
import torch

from cpumoe import memory, ops
from cpumoe.memory import HugePageUse

HAS_SMAPS = Path("/proc/self/smaps").is_file()


@pytest.mark.skipif(not HAS_SMAPS, reason="no /proc/self/smaps")
def test_packed_weights_count_as_advised_memory():
    """A packed weight is memory of its own that asked for huge pages, numbered as it is mapped: the buffers mapped
    since a number are exactly the live packed weights made after it, and their advised resident size is their
    bytes, whatever other packed weights are freed meanwhile (a difference of two process-wide reads was not)."""
    weight = torch.randn(2048, 2048).to(torch.bfloat16)  # 8 MB
    earlier = ops.pack_linear(weight, "generic")  # every machine has it
    first = ops.next_huge_mapping()
    plain = torch.ones(4096, 1024)  # 16 MB of ordinary memory, touched
    assert ops.huge_mappings_since(first) == []
    packed = ops.pack_linear(weight, "generic")
    del earlier  # freed after the mark: not counted, and not taken off either
    nbytes = packed.numel() * packed.element_size()
    regions = ops.huge_mappings_since(first)
    assert regions == [(packed.data_ptr(), nbytes)]
    use = memory.advised_memory(regions)
    assert use.advised_gb == pytest.approx(nbytes / 1e9, rel=0.01)
    assert 0 <= use.huge_gb <= use.advised_gb
    del packed
    assert ops.huge_mappings_since(first) == [] and memory.advised_memory([]).advised_gb == 0
    del plain


def test_huge_page_use_share():
    assert HugePageUse(advised_gb=2.0, huge_gb=1.5).share == pytest.approx(0.75)
    assert HugePageUse(0.0, 0.0).share is None


def test_overlap_of_a_mapping_with_regions():
    spans = [(100, 200), (300, 400), (500, 600)]
    assert memory._overlap(spans, 150, 350) == 50 + 50
    assert memory._overlap(spans, 0, 1000) == 300
    assert memory._overlap(spans, 200, 300) == 0 and memory._overlap(spans, 650, 700) == 0
    assert memory._overlap(spans, 550, 560) == 10


def test_free_huge_blocks_counts_orders_of_2mb_and_up():
    # orders 0..10 (4 KB .. 4 MB): two blocks of order 9 (2 MB each), one of order 10 (4 MB); the rest are smaller
    text = ("Node 0, zone      DMA      5      0      0      0      0      0      0      0      0      0      0\n"
            "Node 0, zone   Normal     10     20     30      0      0      0      0      0      7      2      1\n")
    assert memory.free_huge_blocks_gb(text) == pytest.approx((2 * 2 + 4) * 2**20 / 1e9)
    assert memory.free_huge_blocks_gb("") == 0


def test_loader_warns_when_packed_weights_miss_huge_pages(caplog):
    from cpumoe.models import _log_huge_pages
    with caplog.at_level(logging.INFO, logger="cpumoe"):
        _log_huge_pages(HugePageUse(advised_gb=2.0, huge_gb=0.9))
        _log_huge_pages(HugePageUse(advised_gb=2.0, huge_gb=2.0))
        _log_huge_pages(HugePageUse(advised_gb=0.0, huge_gb=0.0))  # nothing packed: nothing to say
    warning, info = caplog.records
    assert warning.levelno == logging.WARNING and "only 45% of 2.00 GB got 2 MB pages" in warning.getMessage()
    assert memory.huge_page_advice().split(";")[0] in warning.getMessage()
    assert info.levelno == logging.INFO and "2.00 GB, 100% on 2 MB pages" in info.getMessage()


def test_checkpoint_read_drops_the_tensor_pages(tmp_path, monkeypatch):
    """Checkpoint.read tells the kernel each tensor's file pages will not be read again, so a page cache full of
    checkpoint files does not take the free memory huge pages need."""
    import os

    from safetensors.torch import save_file

    from cpumoe.loader import Checkpoint
    save_file({"a": torch.zeros(100), "b": torch.ones(3, 7)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    dropped = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: dropped.append((length, advice)),
                        raising=False)
    ckpt = Checkpoint(tmp_path)
    assert torch.equal(ckpt.read("b"), torch.ones(3, 7))
    ckpt.read("a")
    assert dropped == [(3 * 7 * 4, os.POSIX_FADV_DONTNEED), (100 * 4, os.POSIX_FADV_DONTNEED)]
