"""torch's GEMMs (matmul, linear, scaled-dot-product attention) in a dtype this CPU has a vector path for.

On x86 torch runs bf16 and fp16 GEMMs through oneDNN only on AVX-512 CPUs; on an AVX2 CPU they fall back to
scalar loops, 50-250x slower than float32's (measured on a Zen 3: 0.3-1.3 against 60-80 GFLOP/s). There these
helpers compute on float32 copies and round the result to the operands' dtype, where a bf16 GEMM rounds its
float32 accumulation: the same maths, at float32's speed. Elsewhere they are torch's own calls.
"""
from __future__ import annotations

import functools
import platform

import torch
import torch.nn.functional as F


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype itself where torch has a vector GEMM for it on this CPU, float32 where it has none."""
    if dtype in (torch.bfloat16, torch.float16) and not _half_gemm_is_vectorized():
        return torch.float32
    return dtype


@functools.cache
def _half_gemm_is_vectorized() -> bool:
    return platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability() == "AVX512"


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul(a, b), rounded to a's dtype."""
    dtype = gemm_dtype(a.dtype)
    if dtype == a.dtype:
        return torch.matmul(a, b)
    return torch.matmul(a.to(dtype), b.to(dtype)).to(a.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), rounded to x's dtype."""
    dtype = gemm_dtype(x.dtype)
    if dtype == x.dtype:
        return F.linear(x, weight, bias)
    return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)).to(x.dtype)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v, **kwargs), rounded to q's dtype. The float32 form keeps its
    probabilities in float32 where the bf16 kernel rounds them: within the bf16 kernel's own error."""
    dtype = gemm_dtype(q.dtype)
    if dtype == q.dtype:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), **kwargs).to(q.dtype)
