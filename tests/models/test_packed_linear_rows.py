"""A packed projection in batch-invariant mode gives each row the bits it has alone, on every backend: x86-amx (AMX
tiles from 4 rows a call, AVX-512 tiles below, which round some sums differently) hands the weight to the backend
that packs alike."""
import pytest
import torch

from cpumoe.experts import ExpertsConfig, all_backends
from cpumoe.models.packed_linear import PackedLinear

BF16 = ExpertsConfig(hidden_size=64, inter_size=64, num_experts=1, top_k=1, dtype=torch.bfloat16)
NATIVE = [p.name for p in all_backends() if p.name != "naive" and p.is_supported(BF16)[0]]


@pytest.mark.parametrize("backend", NATIVE)
def test_rows_alone_and_in_a_batch_agree_once_batch_invariant(backend):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 128, generator=g) / 128**0.5).bfloat16()
    x = torch.randn(64, 128, generator=g).bfloat16()
    linear = PackedLinear(w, backend=backend)
    linear.make_batch_invariant()
    assert linear.backend != "x86-amx" and (backend == "x86-amx" or linear.backend == backend)
    alone = torch.cat([linear(x[r:r + 1]) for r in range(len(x))])
    assert torch.equal(alone, linear(x))
