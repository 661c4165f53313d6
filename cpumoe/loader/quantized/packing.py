"""4-bit codes packed into int32 words (GPTQ, AWQ, compressed-tensors) or byte pairs (MXFP4), and back.

int32 words: 8 codes a word along one dim; nibble i (bits 4i..4i+3) of a word holds element order[i] of its 8.
    sequential (GPTQ, compressed-tensors pack_to_int32):  order 0 1 2 3 4 5 6 7
    AWQ (AutoAWQ's gemm pack, AWQ_ORDER):                order 0 2 4 6 1 3 5 7
Byte pairs: element 2j in the low nibble of byte j, 2j + 1 in the high nibble (gpt-oss, compressed-tensors
pack_fp4_to_uint8).
"""
from __future__ import annotations

import torch

SEQUENTIAL = (0, 1, 2, 3, 4, 5, 6, 7)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(8, dtype=torch.int64) * 4


def pack_int32(codes: torch.Tensor, dim: int, order: tuple[int, ...] = SEQUENTIAL) -> torch.Tensor:
    """uint8 codes 0..15, dim a multiple of 8 long (pad first) -> int32 with that dim 8 times shorter."""
    x = codes.movedim(dim, -1).to(torch.int64)
    x = x.unflatten(-1, (-1, 8))[..., list(order)]  # [.., words, 8]: nibble i <- element order[i]
    words = (x << _SHIFTS).sum(dim=-1)  # 0 .. 2^32 - 1
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same bits as int32
    return words.movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, dim: int, order: tuple[int, ...] = SEQUENTIAL) -> torch.Tensor:
    """The inverse of pack_int32: int32 -> uint8 codes, dim 8 times longer."""
    words = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    nibbles = (words[..., None] >> _SHIFTS) & 0xF  # [.., words, 8]: nibble i
    inverse = sorted(range(8), key=lambda i: order[i])  # element j sits in nibble inverse[j]
    codes = nibbles[..., inverse].flatten(-2).to(torch.uint8)
    return codes.movedim(-1, dim).contiguous()


def pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """Zero-pad `dim` up to a multiple (compressed-tensors packs a ragged last word with zeros)."""
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return torch.nn.functional.pad(t, pad)


def pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [.., K] (K even) -> uint8 [.., K/2], low nibble first."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [.., K/2] -> codes [.., K]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).contiguous()
