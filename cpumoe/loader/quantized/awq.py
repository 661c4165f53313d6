"""AWQ checkpoints (AutoAWQ / llm-awq, version "gemm"; quant_method "awq"), 4-bit with zero points.

quantization_config: {"quant_method": "awq", "bits": 4, "group_size": g, "version": "gemm", "zero_point": true,
  "modules_to_not_convert": [...]}

    {p}.qweight int32 [K, N/8]    codes packed 8 a word along N in AWQ's interleaved order: nibble i of word j holds
                                  output channel 8j + AWQ_ORDER[i], AWQ_ORDER = 0 2 4 6 1 3 5 7
    {p}.qzeros  int32 [K/g, N/8]  zeros 0..15, packed the same way
    {p}.scales  fp16 [K/g, N]
    value w[n, k] = (q[n, k] - z[n, k // g]) * s[k // g, n]

Only "gemm" is read: "gemv" packs along K with another order. Written scales are fp16 (see gptq.py).
"""
from __future__ import annotations

import torch

from cpumoe.loader.checkpoint import Checkpoint, CheckpointError
from cpumoe.loader.quantized.common import (FLOATS, Layout, divides, read_checked, unquantized_or_missing,
                                             validated)
from cpumoe.loader.quantized.packing import AWQ_ORDER, pack_int32, unpack_int32
from cpumoe.quant.formats import QuantFormat, QuantizedWeight

METHOD = "awq"
SYMMETRIC_ZERO = 8


class Awq(Layout):
    method = METHOD
    format = QuantFormat.INT4_W4A16

    def __init__(self, group_size: int, zero_point: bool = True):
        self.group_size, self.zero_point = group_size, zero_point

    @classmethod
    def from_config(cls, qc: dict, ckpt: Checkpoint) -> Awq:
        bits = qc.get("bits", qc.get("w_bit", 4))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise CheckpointError(f"{ckpt.path}: AWQ {bits}-bit version {version!r} is not supported "
                                  "(4-bit gemm only)")
        return cls(int(qc.get("group_size", qc.get("q_group_size", 128))), bool(qc.get("zero_point", True)))

    def read(self, ckpt: Checkpoint, prefix: str) -> QuantizedWeight | None:
        name = f"{prefix}.qweight"
        if name not in ckpt:
            return unquantized_or_missing(ckpt, prefix, name)
        packed = read_checked(ckpt, name, (torch.int32,), (None, None))
        K, N = packed.shape[0], packed.shape[1] * 8
        g = K if self.group_size == -1 else self.group_size
        divides(g, K, name)
        scales = read_checked(ckpt, f"{prefix}.scales", FLOATS, (K // g, N)).float()
        zeros = unpack_int32(read_checked(ckpt, f"{prefix}.qzeros", (torch.int32,), (K // g, N // 8)), 1, AWQ_ORDER)
        zeros = zeros.T.contiguous()  # [N, K/g]
        if not self.zero_point and bool((zeros == SYMMETRIC_ZERO).all()):
            zeros = None
        codes = unpack_int32(packed, 1, AWQ_ORDER).T.contiguous()  # [N, K]
        return validated(QuantizedWeight(self.format, codes, scales.T.contiguous(), zeros, g), name)

    def accepts(self, N: int, K: int) -> str:
        if K % self.group_size:
            return f"group size {self.group_size} does not divide K={K}"
        return "" if N % 8 == 0 else f"N={N} is not a multiple of 8"

    def write(self, prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        zeros = qw.zeros if qw.zeros is not None else torch.full_like(qw.scales, SYMMETRIC_ZERO, dtype=torch.uint8)
        return {f"{prefix}.qweight": pack_int32(qw.qweight.T, 1, AWQ_ORDER),  # [K, N/8]
                f"{prefix}.qzeros": pack_int32(zeros.T, 1, AWQ_ORDER),  # [K/g, N/8]
                f"{prefix}.scales": qw.scales.T.to(torch.float16).contiguous()}  # [K/g, N]

    def config(self, unquantized: list[str]) -> dict:
        return dict(quant_method=METHOD, bits=4, group_size=self.group_size, version="gemm",
                    zero_point=self.zero_point, modules_to_not_convert=list(unquantized))
