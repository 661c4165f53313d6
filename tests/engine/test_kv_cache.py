"""The KV cache's tensors: zeros, on memory of their own, on 2 MB pages where Linux gives them for the asking."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from cpumoe.attention.layout import KVCacheLayout
from cpumoe.engine import kv_cache
from cpumoe.engine.kv_cache import KVCache
from cpumoe.memory import HUGE_PAGES_WANTED, HugePageUse
from tests.kernels.test_huge_pages import HUGE, _thp_on_request, huge_page_bytes

LAYOUT = KVCacheLayout(num_kv_heads=4, k_dim=128, v_dim=128)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not _thp_on_request(),
                    reason="transparent huge pages are not given on request here")
def test_kv_cache_sits_on_huge_pages():
    """A decode step reads each sequence's keys block by block from anywhere in the cache: on 4 KB pages each block
    was a TLB miss."""
    cache = KVCache(num_layers=2, num_blocks=512, block_size=16, layout=LAYOUT, dtype=torch.bfloat16)  # 4 MB each
    assert cache.huge_pages.share is not None and cache.huge_pages.share >= HUGE_PAGES_WANTED
    for k, v in cache.layers:
        for t in (k, v):
            assert t.shape == (512, 16, 4, 128) and t.data_ptr() % HUGE == 0 and not t.any()
            assert huge_page_bytes(t) >= t.nbytes // HUGE * HUGE


def test_kv_cache_without_values_has_empty_v():
    cache = KVCache(num_layers=1, num_blocks=4, block_size=16, layout=KVCacheLayout(1, 576, 0), dtype=torch.float32)
    k, v = cache.layers[0]
    assert k.shape == (4, 16, 1, 576) and v.shape == (4, 16, 1, 0)


def test_kv_cache_says_when_it_misses_huge_pages(monkeypatch, caplog):
    monkeypatch.setattr(kv_cache, "advised_memory", lambda regions: HugePageUse(advised_gb=1.0, huge_gb=0.25))
    with caplog.at_level(logging.WARNING, logger="cpumoe"):
        KVCache(num_layers=1, num_blocks=4, block_size=16, layout=LAYOUT, dtype=torch.bfloat16)
    assert "KV cache: only 25% of 1.00 GB got 2 MB pages" in caplog.text
