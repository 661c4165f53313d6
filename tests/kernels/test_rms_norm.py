"""The fused RMSNorm (ops.rms_norm) against transformers' maths (blocks.rms_norm_reference), both weight orders, over
row counts that stay on one thread and ones split over the pool, widths that fill and do not fill a vector."""
import pytest
import torch

from cpumoe import ops
from cpumoe.models.blocks import rms_norm_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows, dim", [(1, 2048), (3, 7), (40, 129), (5, 1), (17, 64)])
@pytest.mark.parametrize("weight_in_float", [False, True])
def test_matches_reference(dtype, rows, dim, weight_in_float):
    g = torch.Generator().manual_seed(rows * 1000 + dim)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    w = (1 + torch.randn(dim, generator=g) * 0.1).to(dtype)
    out = ops.rms_norm(x, w, 1e-6, weight_in_float=weight_in_float)
    ref = rms_norm_reference(x, w, 1e-6, weight_in_float)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    # the sum of squares is added in another order, so r may differ in its last bit: an output then rounds to
    # the neighbouring value (one unit in the last place of the dtype), rarely
    ulp = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulp, atol=ulp)
    if dtype != torch.float32:  # (in float32 a row whose r differs differs everywhere, by an ulp)
        assert (out == ref).float().mean() > 0.97


def test_any_leading_shape_and_empty():
    x = torch.randn(2, 3, 4, 32).bfloat16()
    w = torch.rand(32).bfloat16()
    assert torch.equal(ops.rms_norm(x, w, 1e-5).view(-1, 32), ops.rms_norm(x.view(-1, 32), w, 1e-5))
    assert ops.rms_norm(torch.empty(0, 32).bfloat16(), w, 1e-5).shape == (0, 32)


def test_module_uses_it_and_keeps_promotion():
    from cpumoe.models.blocks import RMSNorm
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(3, 16)
    assert torch.equal(norm(x), ops.rms_norm(x, norm.weight.detach(), 1e-6))
    # a float32 weight over bf16 activations promotes, as transformers' does: torch's maths, float32 out
    assert norm(x.bfloat16()).dtype == torch.float32


@pytest.mark.parametrize("x, w, message", [
    (torch.randn(4, 8), torch.randn(9), "weight must be"),
    (torch.randn(4, 8).bfloat16(), torch.randn(8), "weight must be"),
    (torch.randn(8, 4).t(), torch.randn(8), "contiguous"),
    (torch.randn(4, 8).double(), torch.randn(8).double(), "float32, bfloat16 or float16"),
])
def test_bad_input_is_refused(x, w, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        ops.rms_norm(x, w, 1e-6)


def test_fake_kernel():
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        out = torch.ops.cpumoe.rms_norm(mode.from_tensor(torch.randn(3, 8).bfloat16()),
                                        mode.from_tensor(torch.randn(8).bfloat16()), 1e-6, False)
    assert out.shape == (3, 8) and out.dtype == torch.bfloat16
