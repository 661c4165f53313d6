"""A quantizer and a dequantizer per format (the semantics of formats.py), in plain PyTorch.

Quantizers take float weights [.., N, K] and round to nearest; they are what `FusedMoE(quant=...)` and
`cpumoe quantize` use, and what tests use to make quantized layers. Dequantizers return float32.
"""
from __future__ import annotations

import math

import torch

from cpumoe.quant.formats import FP8_BLOCK, MXFP4_GROUP, QuantFormat, QuantizedWeight, concat_leading, parse_format

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP8_MAX = 448.0
E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # between E2M1's magnitudes in turn
# The quantizers make float32 and int64 temporaries several times their input's size, so quantize() takes a stack
# [E, N, K] a few whole experts at a time (a 2-D weight a band of rows at a time), this many elements a slice at most
# (one expert when one is larger): a 128-expert layer then needs its result and a slice's temporaries, not 30x itself.
SLICE_ELEMENTS = 1 << 24
SLICE_TEMPORARY_BYTES = 32 * SLICE_ELEMENTS  # the most a slice's temporaries take (mxfp4's ~28 bytes an element)


def quantize(weight: torch.Tensor, format: str | QuantFormat, group_size: int | None = None,
             symmetric: bool = True) -> QuantizedWeight:
    """weight [.., N, K] float -> QuantizedWeight. group_size: int4 group (default 128; K for per channel),
    fp8 k block (default 128); int8 is per channel, mxfp4 groups of 32. symmetric=False gives int4 zero points."""
    f = parse_format(format)
    K = weight.shape[-1]
    if f is QuantFormat.INT4_W4A16:
        group_size = group_size or (128 if K % 128 == 0 else K)
    elif f is QuantFormat.FP8_W8A16:
        group_size = group_size or FP8_BLOCK
    step = _slice_step(weight, f, group_size)
    if step >= weight.shape[0]:
        return _quantize_slice(weight, f, group_size, symmetric)
    return concat_leading([_quantize_slice(weight[i:i + step], f, group_size, symmetric)
                           for i in range(0, weight.shape[0], step)])


def _slice_step(weight: torch.Tensor, f: QuantFormat, group_size: int | None) -> int:
    """How many of weight's leading slices (experts of a stack, rows of a 2-D weight) quantize() takes at once."""
    step = max(1, SLICE_ELEMENTS // max(weight[0].numel(), 1))
    if weight.dim() == 2 and f is QuantFormat.FP8_W8A16:  # a band of whole blocks
        step = max(group_size, step // group_size * group_size)
    return step


def _quantize_slice(weight: torch.Tensor, f: QuantFormat, group_size: int | None, symmetric: bool) -> QuantizedWeight:
    w = weight.float()
    if f is QuantFormat.INT8_W8A8:
        return quantize_int8(w)
    if f is QuantFormat.INT4_W4A16:
        return quantize_int4(w, group_size, symmetric)
    if f is QuantFormat.FP8_W8A16:
        return quantize_fp8(w, group_size)
    return quantize_mxfp4(w)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """QuantizedWeight -> float32 [.., N, K]."""
    f, q, s, g = qw.format, qw.qweight, qw.scales, qw.group_size
    if f is QuantFormat.INT8_W8A8:
        return q.float() * s.float()[..., None]
    if f is QuantFormat.INT4_W4A16:
        zeros = qw.zeros.float() if qw.zeros is not None else torch.full_like(s, 8.0)
        groups = q.float().unflatten(-1, (-1, g))  # [.., N, K/g, g]
        return ((groups - zeros[..., None]) * s[..., None]).flatten(-2)
    if f is QuantFormat.FP8_W8A16:
        K = q.shape[-1]
        return q.float() * s.repeat_interleave(g, dim=-1)[..., :K]
    values = E2M1_VALUES[q.long()]  # [.., N, K]
    exps = torch.ldexp(torch.ones(s.shape), s.int() - 127)  # 2^(e - 127)
    return (values.unflatten(-1, (-1, MXFP4_GROUP)) * exps[..., None]).flatten(-2)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric per output channel: s = max|w| / 127."""
    scales = w.abs().amax(dim=-1) / 127.0
    q = torch.where(scales[..., None] > 0, w / scales.clamp(min=torch.finfo(torch.float32).tiny)[..., None],
                    torch.zeros_like(w))
    return QuantizedWeight(QuantFormat.INT8_W8A8, q.round().clamp(-127, 127).to(torch.int8),
                           scales.float().contiguous(), None, w.shape[-1])


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool = True) -> QuantizedWeight:
    """Per group of group_size along K. Symmetric: s = max|w| / 8 (7.5 when max is positive-only would lose
    range; GPTQ uses max/8 with codes -8..7, stored + 8), zero 8. Asymmetric: s = (max - min) / 15,
    zero = round(-min / s)."""
    K = w.shape[-1]
    if group_size <= 0 or K % group_size:
        raise ValueError(f"int4 group size {group_size} must divide K={K}")
    groups = w.unflatten(-1, (-1, group_size))  # [.., N, K/g, g]
    tiny = torch.finfo(torch.float32).tiny
    if symmetric:
        scales = groups.abs().amax(dim=-1) / 8.0
        q = (groups / scales.clamp(min=tiny)[..., None]).round().clamp(-8, 7) + 8
        zeros = None
    else:
        lo, hi = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
        scales = (hi - lo) / 15.0
        zeros_f = (-lo / scales.clamp(min=tiny)).round().clamp(0, 15)
        q = (groups / scales.clamp(min=tiny)[..., None] + zeros_f[..., None]).round().clamp(0, 15)
        zeros = zeros_f.to(torch.uint8).contiguous()
    return QuantizedWeight(QuantFormat.INT4_W4A16, q.flatten(-2).to(torch.uint8).contiguous(),
                           scales.float().contiguous(), zeros, group_size)


def quantize_fp8(w: torch.Tensor, block: int = FP8_BLOCK) -> QuantizedWeight:
    """Block FP8 as DeepSeek-V3 / Qwen3-FP8: one scale per block x block tile, s = max|w| / 448; the scale of
    a tile is repeated on each of its rows (the row-wise form formats.py keeps)."""
    N, K = w.shape[-2:]
    nb, kb = math.ceil(N / block), math.ceil(K / block)
    padded = torch.nn.functional.pad(w, (0, kb * block - K, 0, nb * block - N))
    tiles = padded.unflatten(-1, (kb, block)).unflatten(-3, (nb, block))  # [.., nb, block, kb, block]
    tile_scales = tiles.abs().amax(dim=(-3, -1)) / FP8_MAX  # [.., nb, kb]
    row_scales = tile_scales.repeat_interleave(block, dim=-2)[..., :N, :]  # [.., N, kb]
    safe = row_scales.clamp(min=torch.finfo(torch.float32).tiny).repeat_interleave(block, dim=-1)[..., :K]
    q = (w / safe).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(QuantFormat.FP8_W8A16, q.contiguous(), row_scales.float().contiguous(), None, block)


def quantize_mxfp4(w: torch.Tensor) -> QuantizedWeight:
    """OCP MX: per 32 along K, e = floor(log2(max|w|)) - 2 (so the largest value lands in E2M1's [4, 6]
    range), codes rounded to the nearest E2M1 value."""
    K = w.shape[-1]
    if K % MXFP4_GROUP:
        raise ValueError(f"mxfp4 needs K={K} to be a multiple of {MXFP4_GROUP}")
    groups = w.unflatten(-1, (-1, MXFP4_GROUP))
    amax = groups.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones(exp.shape), exp.int())[..., None]
    codes = torch.bucketize(scaled.abs(), E2M1_MIDPOINTS)  # nearest magnitude (ties: the smaller)
    codes = torch.where((scaled < 0) & (codes > 0), codes + 8, codes)
    return QuantizedWeight(QuantFormat.MXFP4_W4A16, codes.flatten(-2).to(torch.uint8).contiguous(),
                           (exp + 127).to(torch.uint8).contiguous(), None, MXFP4_GROUP)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8, as the kernels do it: s = max|x| / 127, a = round_half_even(x / s).
    x [M, K] -> (a int8 [M, K], s float32 [M]). Rows of zeros get s = 0 and a = 0."""
    xf = x.float()
    scales = xf.abs().amax(dim=-1) / 127.0
    a = torch.where(scales[:, None] > 0, xf / scales.clamp(min=torch.finfo(torch.float32).tiny)[:, None],
                    torch.zeros_like(xf))
    return a.round().clamp(-127, 127).to(torch.int8), scales
