"""The fused RMSNorm (ops.rms_norm) against transformers' maths (blocks.rms_norm_reference), both weight orders, over
row counts that stay on one thread and ones split over the pool, widths that fill and do not fill a vector; and
ops.add_rms_norm (the residual add in the same pass) against torch's add followed by ops.rms_norm, bit for bit."""
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows, dim", [(1, 2048), (3, 7), (40, 129), (5, 1), (17, 64)])
@pytest.mark.parametrize("weight_in_float", [False, True])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, rows, dim, weight_in_float):
    g = torch.Generator().manual_seed(rows * 7 + dim)
    x, residual = ((torch.randn(rows, dim, generator=g) * 3).to(dtype) for _ in range(2))
    w = (1 + torch.randn(dim, generator=g) * 0.1).to(dtype)
    out, total = ops.add_rms_norm(x, residual, w, 1e-6, weight_in_float=weight_in_float)
    want_total = x + residual  # torch's add: the float32 sum rounded to the dtype
    assert torch.equal(total, want_total)
    assert torch.equal(out, ops.rms_norm(want_total, w, 1e-6, weight_in_float=weight_in_float))
    assert torch.equal(x + residual, want_total), "the inputs are left as they were"


def test_add_and_norm_module_falls_back_where_the_op_does_not_run():
    from cpumoe.models.blocks import RMSNorm
    norm = RMSNorm(16, 1e-6)
    x, residual = torch.randn(3, 16).bfloat16(), torch.randn(3, 16).bfloat16()
    out, total = norm.add_and_norm(x, residual)  # a float32 weight: torch's add, then the promoting reference
    assert torch.equal(total, x + residual) and torch.equal(out, norm(x + residual)) and out.dtype == torch.float32
    norm = norm.bfloat16()
    out, total = norm.add_and_norm(x, residual)
    assert torch.equal(total, x + residual) and torch.equal(out, norm(x + residual))


@pytest.mark.parametrize("residual, message", [
    (torch.randn(4, 9).bfloat16(), "residual must be a contiguous CPU tensor of x's shape and dtype"),
    (torch.randn(4, 8), "residual must be .* BFloat16"),
    (torch.randn(8, 4).bfloat16().t(), "residual must be a contiguous"),
])
def test_add_rms_norm_refuses_a_bad_residual(residual, message):
    with pytest.raises(ValueError, match=message):
        ops.add_rms_norm(torch.randn(4, 8).bfloat16(), residual, torch.ones(8).bfloat16(), 1e-6)


def test_add_rms_norm_fake_kernel():
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        out, total = torch.ops.cpumoe.add_rms_norm(*(mode.from_tensor(t) for t in (
            torch.randn(3, 8).bfloat16(), torch.randn(3, 8).bfloat16(), torch.randn(8).bfloat16())), 1e-6, False)
    assert out.shape == total.shape == (3, 8) and out.dtype == total.dtype == torch.bfloat16
