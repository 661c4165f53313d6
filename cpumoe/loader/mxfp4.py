"""MXFP4 weights on disk (openai/gpt-oss checkpoints): dequantized to the model dtype, one expert at a time.

MXFP4 is the OCP Microscaling format, blocks of 32 values sharing one power-of-two scale, each value a 4-bit e2m1
float (spec: https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf).
A checkpoint stores a weight W [..., rows, cols] (out features x in features) as two uint8 tensors, laid out as
transformers' integrations/mxfp4.py (`convert_moe_packed_tensors`) reads them:

    {name}_blocks [..., rows, cols / 32, 16]  two e2m1 codes a byte: column 32g + 2j in the low nibble of byte j,
                                               column 32g + 2j + 1 in the high nibble
    {name}_scales [..., rows, cols / 32]      e8m0 exponents, biased by 127: block g is scaled by 2^(s - 127)
    W[r, 32g + 2j] = FP4_VALUES[blocks[r, g, j] & 0xF] * 2^(scales[r, g] - 127); the high nibble likewise

e2m1 code c: bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6. Every such value times a power of two in
bf16's (or fp32's) exponent range is exact, so dequantizing to bf16 or fp32 loses nothing.
"""
from __future__ import annotations

import torch

from cpumoe.loader.checkpoint import Checkpoint, CheckpointError

QUANT_METHOD = "mxfp4"
BLOCK = 32  # values per scale
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., rows, G, 16], scales uint8 [..., rows, G] -> W [..., rows, G * 32] in dtype."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: expected "
                         f"blocks [..., G, {BLOCK // 2}] and scales [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]: low nibble, high nibble, next byte
    out = torch.ldexp(values, scales.to(torch.int32)[..., None] - SCALE_BIAS)  # [..., G, 32]
    return out.flatten(-2).to(dtype)  # [..., rows, cols]


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., rows, cols] (cols a multiple of 32) -> (blocks uint8 [..., rows, cols / 32, 16], scales uint8
    [..., rows, cols / 32]), round to nearest: each block's scale is the smallest power of two that brings its
    largest magnitude within 6. The inverse of `dequantize` up to rounding; for tests and synthetic checkpoints."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 quantizes rows of a multiple of {BLOCK} values, got {w.shape[-1]}")
    x = w.float().unflatten(-1, (-1, BLOCK))  # [..., rows, G, 32]
    amax = x.abs().amax(dim=-1)  # [..., rows, G]
    exp = torch.ceil(torch.log2(amax / FP4_VALUES[7])).nan_to_num(0.0, neginf=0.0)  # 2^exp * 6 >= amax
    exp = exp.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = torch.ldexp(x, -exp.to(torch.int32)[..., None])  # [..., rows, G, 32], |.| <= 6
    magnitudes = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # [..., rows, G, 32] in 0..7
    codes = (codes | (scaled < 0).long() << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., rows, G, 16]
    return blocks, (exp + SCALE_BIAS).to(torch.uint8)


def check_quantization(ckpt: Checkpoint, supported: tuple[str, ...] = (QUANT_METHOD,)) -> str | None:
    """config.json's quantization_config.quant_method (None when the checkpoint is not quantized); a
    CheckpointError that names it when it is not one of `supported`."""
    qc = ckpt.config_get("quantization_config", default=None)
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in supported:
        raise CheckpointError(f"{ckpt.path}: quantization_config quant_method {method!r} is not supported "
                              f"(supported: {', '.join(supported) or 'none'})")
    return method


def read_expert(ckpt: Checkpoint, name: str, expert: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Expert `expert`'s W [rows, cols] in dtype from the fused MXFP4 tensors {name}_blocks [E, rows, cols / 32, 16]
    and {name}_scales [E, rows, cols / 32]; reads only that expert's bytes."""
    rows, cols = shape
    if cols % BLOCK:
        raise CheckpointError(f"{name}: MXFP4 needs a multiple of {BLOCK} input features, got {cols}")
    parts = {}
    for suffix, expected in (("blocks", (rows, cols // BLOCK, BLOCK // 2)), ("scales", (rows, cols // BLOCK))):
        tensor = f"{name}_{suffix}"
        if tensor not in ckpt:
            raise CheckpointError(f"MXFP4 tensor {tensor!r} not found in checkpoint {ckpt.path}")
        on_disk = tuple(ckpt.shape(tensor))
        if len(on_disk) != 3 + (suffix == "blocks") or on_disk[1:] != expected or ckpt.dtype(tensor) != torch.uint8:
            raise CheckpointError(f"MXFP4 tensor {tensor!r} in {ckpt.path} is {ckpt.dtype(tensor)} {list(on_disk)}, "
                                  f"expected uint8 [E, {', '.join(map(str, expected))}]")
        parts[suffix] = ckpt.read(tensor, index=expert)
    return dequantize(parts["blocks"], parts["scales"], dtype)  # [rows, cols]
