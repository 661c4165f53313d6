"""One tolerance table for every kernel test, per dtype.

Errors are measured against cpumoe.reference (float32 maths with the kernels' rounding steps), relative to
the largest |reference| value: the kernels sum in another order, so a bf16 output may land one ulp (2^-8
relative) away, and the bf16 intermediate can round the other way for a few elements.
"""
import torch

TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def assert_moe_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, msg: str = "",
                     table: dict = TOLERANCES) -> None:
    assert out.dtype == ref.dtype == dtype, f"{msg}: dtypes {out.dtype}, {ref.dtype}, expected {dtype}"
    assert out.shape == ref.shape, f"{msg}: shape {list(out.shape)} != reference {list(ref.shape)}"
    scale = max(ref.float().abs().max().item(), 1e-6)
    tol = table[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol["atol"] * scale, rtol=tol["rtol"],
                               msg=lambda m: f"{msg}: {m}")


# Quantized formats, against cpumoe.reference.quantized_fused_experts (the same quantized maths in float32). The
# integer sums are exact, but the float32 intermediate can land on the other side of an int8 rounding boundary
# for a few elements (the kernels' exp and the order of float32 operations differ), which moves those outputs by
# up to one activation step (1/127 of the row's max): hence a looser float32 budget than the unquantized one.
QUANT_TOLERANCES = {
    torch.float32: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: TOLERANCES[torch.bfloat16],
    torch.float16: dict(atol=2e-3, rtol=4e-3),
}


def assert_quant_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, msg: str = "") -> None:
    assert_moe_close(out, ref, dtype, msg, QUANT_TOLERANCES)
