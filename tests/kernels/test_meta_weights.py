"""Weights that are meta tensors (shapes without data) against real activations: the op's fake kernel would answer
with uninitialized memory, so every op refuses, naming the tensor; shape tracing (everything meta, or FakeTensorMode)
still works."""
import pytest
import torch

import cpumoe
from cpumoe import ops


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_fused_moe_refuses_meta_weights_without_a_reader():
    with pytest.raises(ValueError, match="meta tensors"):
        cpumoe.FusedMoE(_meta(4, 64, 32), _meta(4, 32, 32), top_k=2)


@pytest.mark.parametrize("call, name", [
    (lambda x: torch.ops.cpumoe.fused_experts(x, _meta(4, 1, 4096), _meta(4, 1, 4096),
                                              torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.int32),
                                              backend="x86-avx512bf16", activation="silu"), "w13, w2"),
    (lambda x: ops.linear(x, _meta(1, 4096), None, backend="x86-avx512bf16", out_features=64), "w is"),
    (lambda x: ops.rms_norm(x, _meta(32), 1e-6), "weight is"),
    (lambda x: ops.decode_attention(x.view(3, 2, 16), _meta(4, 16, 2, 16), _meta(4, 16, 2, 16),
                                    torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                                    torch.ones(3, dtype=torch.long), 0.25), "k_cache, v_cache"),
])
def test_ops_refuse_meta_weights_with_real_activations(call, name):
    with pytest.raises(ValueError, match=f"{name}.*meta"):
        call(torch.randn(3, 32).bfloat16())


def test_all_meta_still_traces():
    x = _meta(3, 32)
    assert ops.rms_norm(x, _meta(32), 1e-6).shape == (3, 32)
    assert ops.linear(x, _meta(1, 4096), None, backend="x86-avx512bf16", out_features=64).shape == (3, 64)
