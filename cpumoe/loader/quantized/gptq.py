"""GPTQ checkpoints (AutoGPTQ / GPTQModel; quant_method "gptq"), 4-bit.

quantization_config: {"quant_method": "gptq", "bits": 4, "group_size": g (-1: one group per row), "sym": bool,
  "desc_act": bool, "checkpoint_format": "gptq" (default) | "gptq_v2", ...}

    {p}.qweight int32 [K/8, N]    codes 0..15 packed 8 a word along K: q[n, k] in bits 4 (k % 8) of word k // 8
    {p}.qzeros  int32 [K/g, N/8]  zeros packed 8 a word along N; "gptq" (v1) stores zero - 1 (a legacy of
                                  AutoGPTQ's kernels, so symmetric 8 is stored as 7), "gptq_v2" the zero itself
    {p}.scales  fp16 [K/g, N]
    {p}.g_idx   int32 [K]         the group of each input channel: k // g, unless act-order (desc_act) permuted it
    value w[n, k] = (q[n, k] - z[n, g_idx[k]]) * s[g_idx[k], n]

Act-order checkpoints (g_idx not k // g) put non-adjacent input channels in one group, which the canonical form
(groups of g adjacent channels) cannot hold: refused. Written scales are fp16, as the format has them (the codes are
the quantizer's, the scales its float32 scales rounded to fp16).
"""
from __future__ import annotations

import torch

from cpumoe.loader.checkpoint import Checkpoint, CheckpointError
from cpumoe.loader.quantized.common import (FLOATS, Layout, divides, read_checked, unquantized_or_missing,
                                             validated)
from cpumoe.loader.quantized.packing import pack_int32, unpack_int32
from cpumoe.quant.formats import QuantFormat, QuantizedWeight

METHOD = "gptq"
SYMMETRIC_ZERO = 8


class Gptq(Layout):
    method = METHOD
    format = QuantFormat.INT4_W4A16

    def __init__(self, group_size: int, symmetric: bool = True, v2: bool = False):
        self.group_size, self.symmetric, self.v2 = group_size, symmetric, v2  # group_size -1: per channel
        self.desc_act = False

    @classmethod
    def from_config(cls, qc: dict, ckpt: Checkpoint) -> Gptq:
        if qc.get("bits", 4) != 4:
            raise CheckpointError(f"{ckpt.path}: GPTQ with {qc.get('bits')} bits is not supported (4 only)")
        version = qc.get("checkpoint_format", "gptq")
        if version not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"{ckpt.path}: GPTQ checkpoint_format {version!r} is not supported "
                                  "(gptq, gptq_v2)")
        layout = cls(int(qc.get("group_size", 128)), bool(qc.get("sym", True)), version == "gptq_v2")
        layout.desc_act = bool(qc.get("desc_act", False))
        return layout

    def read(self, ckpt: Checkpoint, prefix: str) -> QuantizedWeight | None:
        name = f"{prefix}.qweight"
        if name not in ckpt:
            return unquantized_or_missing(ckpt, prefix, name)
        packed = read_checked(ckpt, name, (torch.int32,), (None, None))
        K, N = packed.shape[0] * 8, packed.shape[1]
        if f"{prefix}.g_idx" in ckpt and ckpt.shape(f"{prefix}.g_idx")[0] != K:  # g_idx [K] tells K
            raise CheckpointError(f"tensor {name!r} has shape {list(packed.shape)}, expected "
                                  f"[{ckpt.shape(f'{prefix}.g_idx')[0] // 8}, {N}] (K/8 rows, from g_idx)")
        g = K if self.group_size == -1 else self.group_size
        divides(g, K, name)
        if N % 8:
            raise CheckpointError(f"tensor {name!r}: N={N} output channels is not a multiple of 8")
        _check_g_idx(ckpt, prefix, K, g, self.desc_act)
        scales = read_checked(ckpt, f"{prefix}.scales", FLOATS, (K // g, N)).float()  # [K/g, N]
        zeros = unpack_int32(read_checked(ckpt, f"{prefix}.qzeros", (torch.int32,), (K // g, N // 8)), dim=1)
        if not self.v2:
            zeros = zeros.to(torch.int16) + 1  # stored zero - 1
            if (zeros > 15).any():  # a zero of 0 stored as -1 (0xF): v1 cannot hold it
                raise CheckpointError(f"tensor {prefix + '.qzeros'!r} holds a zero point of 16 (0 stored as -1 "
                                      "in checkpoint_format gptq), outside 0..15")
            zeros = zeros.to(torch.uint8)
        zeros = zeros.T.contiguous()  # [N, K/g]
        if self.symmetric and bool((zeros == SYMMETRIC_ZERO).all()):
            zeros = None
        codes = unpack_int32(packed, dim=0).T.contiguous()  # [N, K]
        return validated(QuantizedWeight(self.format, codes, scales.T.contiguous(), zeros, g), name)

    def accepts(self, N: int, K: int) -> str:
        g = K if self.group_size == -1 else self.group_size
        if K % g or K % 8:
            return f"group size {g} (and 8) must divide K={K}"
        return "" if N % 8 == 0 else f"N={N} is not a multiple of 8"

    def write(self, prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        N, K = qw.shape
        zeros = qw.zeros if qw.zeros is not None else torch.full_like(qw.scales, SYMMETRIC_ZERO, dtype=torch.uint8)
        if not self.v2:
            if (zeros == 0).any():
                raise ValueError(f"{prefix}: a zero point of 0 cannot be stored in GPTQ v1 (zero - 1)")
            zeros = zeros - 1
        return {f"{prefix}.qweight": pack_int32(qw.qweight.T, dim=0),  # [K/8, N]
                f"{prefix}.qzeros": pack_int32(zeros.T, dim=1),  # [K/g, N/8]
                f"{prefix}.scales": qw.scales.T.to(torch.float16).contiguous(),  # [K/g, N]
                f"{prefix}.g_idx": torch.arange(K, dtype=torch.int32) // qw.group_size}

    def config(self, unquantized: list[str]) -> dict:
        return dict(quant_method=METHOD, bits=4, group_size=self.group_size, sym=self.symmetric, desc_act=False,
                    checkpoint_format="gptq_v2" if self.v2 else "gptq", static_groups=False, true_sequential=True,
                    damp_percent=0.01, lm_head="lm_head" not in unquantized,
                    modules_to_not_convert=list(unquantized))


def _check_g_idx(ckpt: Checkpoint, prefix: str, K: int, g: int, desc_act: bool) -> None:
    name = f"{prefix}.g_idx"
    trivial = torch.arange(K, dtype=torch.int32) // g
    if name not in ckpt:
        if desc_act:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {ckpt.path} (desc_act needs it)")
        return
    g_idx = read_checked(ckpt, name, (torch.int32, torch.int64), (K,))
    if not torch.equal(g_idx.to(torch.int32), trivial):
        raise CheckpointError(f"tensor {name!r} is not k // {g}: act-order (desc_act) GPTQ checkpoints are not "
                              "supported; quantize without desc_act")
