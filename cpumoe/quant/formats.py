"""The quantized weight formats and the one in-memory form every producer and consumer shares.

A `QuantizedWeight` is a weight matrix [N, K] (or a stack [E, N, K]) as codes plus scales, one code per
element, rows = output channels. Quantizers (cpumoe.quant.<format>) make it from float weights; checkpoint
readers (cpumoe.loader.quantized) make it from the public layouts; the kernels' packing reads it
(csrc/core/quant.h has the packed block layouts); `dequantize` turns it back into floats for references.

    format       qweight                          scales                                zeros
    int8_w8a8    int8 [.., N, K]                  float32 [.., N]                       -
    int4_w4a16   uint8 codes 0..15 [.., N, K]     float32 [.., N, K/g]                  uint8 [.., N, K/g] or None (= 8)
    fp8_w8a16    float8_e4m3fn [.., N, K]         float32 [.., N, ceil(K/g)]            -
    mxfp4_w4a16  uint8 e2m1 codes 0..15 [.., N, K] uint8 e8m0 exponents [.., N, K/32]   -

Values: int8 w * s[n]; int4 (q - z) * s per group of g along K; fp8 w * s per chunk of g along K (block-FP8
checkpoints' 128 x 128 `weight_scale_inv` expanded to rows); mxfp4 E2M1[q] * 2^(e - 127).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch


class QuantFormat(str, Enum):
    INT8_W8A8 = "int8_w8a8"
    INT4_W4A16 = "int4_w4a16"
    FP8_W8A16 = "fp8_w8a16"
    MXFP4_W4A16 = "mxfp4_w4a16"

    @property
    def int8_activations(self) -> bool:
        """Activations are quantized to int8 per token before each GEMM (int4 and mxfp4 compute as W4A8)."""
        return self is not QuantFormat.FP8_W8A16

    @property
    def bits(self) -> int:
        return 8 if self in (QuantFormat.INT8_W8A8, QuantFormat.FP8_W8A16) else 4


# Short names the CLI and benchmarks accept beside the full ones.
ALIASES = {"int8": QuantFormat.INT8_W8A8, "int4": QuantFormat.INT4_W4A16, "fp8": QuantFormat.FP8_W8A16,
           "mxfp4": QuantFormat.MXFP4_W4A16}
MXFP4_GROUP = 32
FP8_BLOCK = 128


def parse_format(name: str | QuantFormat) -> QuantFormat:
    if isinstance(name, QuantFormat):
        return name
    if name in ALIASES:
        return ALIASES[name]
    try:
        return QuantFormat(name)
    except ValueError:
        known = ", ".join([*(f.value for f in QuantFormat), *ALIASES])
        raise ValueError(f"unknown quantization format {name!r}; known: {known}") from None


@dataclass(slots=True)
class QuantizedWeight:
    format: QuantFormat
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    group_size: int = 0  # int4: g; fp8: the k chunk (128); mxfp4: 32; int8: K (a whole row)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical weight shape [.., N, K]."""
        return tuple(self.qweight.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the format stores (4-bit codes counted as half a byte)."""
        code_bytes = self.qweight.numel() * self.format.bits // 8
        extra = sum(t.numel() * t.element_size() for t in (self.scales, self.zeros) if t is not None)
        return code_bytes + extra

    def __getitem__(self, index) -> QuantizedWeight:
        """One expert (or a range) of a stack: w[e] is [N, K]."""
        return QuantizedWeight(self.format, self.qweight[index], self.scales[index],
                               None if self.zeros is None else self.zeros[index], self.group_size)

    def meta_stack(self, experts: int) -> QuantizedWeight:
        """A stack of `experts` weights of this one's shapes, on the meta device (shapes only, no data)."""
        def meta(t):
            return None if t is None else torch.empty((experts, *t.shape), dtype=t.dtype, device="meta")
        return QuantizedWeight(self.format, meta(self.qweight), meta(self.scales), meta(self.zeros), self.group_size)

    def validate(self, name: str = "weight") -> None:
        """Raises ValueError naming the tensor whose dtype or shape does not fit the format."""
        f, q, s = self.format, self.qweight, self.scales
        if q.dim() < 2:
            raise ValueError(f"{name}: qweight must be [.., N, K], got shape {list(q.shape)}")
        lead, (N, K) = tuple(q.shape[:-2]), tuple(q.shape[-2:])
        want_q = {QuantFormat.INT8_W8A8: torch.int8, QuantFormat.INT4_W4A16: torch.uint8,
                  QuantFormat.FP8_W8A16: torch.float8_e4m3fn, QuantFormat.MXFP4_W4A16: torch.uint8}[f]
        if q.dtype != want_q:
            raise ValueError(f"{name}: {f.value} qweight must be {want_q}, got {q.dtype}")
        g = self.group_size
        if f is QuantFormat.INT8_W8A8:
            want_s, s_dtype = (*lead, N), torch.float32
        elif f is QuantFormat.INT4_W4A16:
            if g <= 0 or K % g or g % 32 and g != K:
                raise ValueError(f"{name}: int4 group size {g} must divide K={K} and be a multiple of 32 "
                                 "(or K itself)")
            want_s, s_dtype = (*lead, N, K // g), torch.float32
        elif f is QuantFormat.FP8_W8A16:
            if g <= 0 or g % 2:
                raise ValueError(f"{name}: fp8 k block {g} must be a positive even number")
            want_s, s_dtype = (*lead, N, math.ceil(K / g)), torch.float32
        else:
            if g != MXFP4_GROUP or K % MXFP4_GROUP:
                raise ValueError(f"{name}: mxfp4 needs group size 32 and K={K} a multiple of 32")
            want_s, s_dtype = (*lead, N, K // MXFP4_GROUP), torch.uint8
        if s.dtype != s_dtype or tuple(s.shape) != want_s:
            raise ValueError(f"{name}: {f.value} scales must be {s_dtype} {list(want_s)}, got {s.dtype} "
                             f"{list(s.shape)}")
        if self.zeros is not None:
            if f is not QuantFormat.INT4_W4A16:
                raise ValueError(f"{name}: {f.value} has no zero points")
            if self.zeros.dtype != torch.uint8 or tuple(self.zeros.shape) != want_s:
                raise ValueError(f"{name}: int4 zeros must be uint8 {list(want_s)}, got {self.zeros.dtype} "
                                 f"{list(self.zeros.shape)}")


def stack(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """[N, K] weights of one format -> one [E, N, K] stack."""
    first = weights[0]
    return QuantizedWeight(first.format, torch.stack([w.qweight for w in weights]),
                           torch.stack([w.scales for w in weights]),
                           None if first.zeros is None else torch.stack([w.zeros for w in weights]),
                           first.group_size)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Row blocks of one format (e.g. gate_proj then up_proj) -> one weight [.., sum N, K]."""
    first = _check_joinable(parts)
    scale_dim = -1 if first.format is QuantFormat.INT8_W8A8 else -2  # int8 scales are [.., N]
    return QuantizedWeight(first.format, torch.cat([p.qweight for p in parts], dim=-2),
                           torch.cat([p.scales for p in parts], dim=scale_dim),
                           None if first.zeros is None else torch.cat([p.zeros for p in parts], dim=-2),
                           first.group_size)


def concat_leading(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Slices of one format along the leading dimension (experts of a stack, or rows of a 2-D weight) -> one
    weight: [sum E, N, K] or [sum N, K]."""
    first = _check_joinable(parts)
    return QuantizedWeight(first.format, torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                           None if first.zeros is None else torch.cat([p.zeros for p in parts]), first.group_size)


def _check_joinable(parts: list[QuantizedWeight]) -> QuantizedWeight:
    first = parts[0]
    if any(p.format is not first.format or p.group_size != first.group_size for p in parts):
        raise ValueError("cannot concatenate weights of different formats or group sizes")
    if any((p.zeros is None) != (first.zeros is None) for p in parts):
        raise ValueError("cannot concatenate symmetric and zero-point weights")
    return first
