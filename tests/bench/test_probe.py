"""The read-bandwidth probe: its buffer covers what was asked, in whole chunks, at any thread count."""
import pytest
import torch

from cpumoe import ops


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("nbytes", [8 << 20, (1 << 20) + 1, 1000])
def test_probe_reads_at_least_what_was_asked(threads, nbytes):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        probe = ops.ReadBandwidthProbe(nbytes)
        chunks = 16 * threads
        assert probe.bytes >= nbytes and probe.bytes % (4096 * chunks) == 0
        assert probe.bytes < max(nbytes, 4096 * chunks) + 4096 * chunks
        assert all(probe.read_gbps() > 0 for _ in range(3))
        best, median = ops.measure_read_bandwidth(nbytes, repetitions=3)
        assert best >= median > 0
    finally:
        torch.set_num_threads(before)
