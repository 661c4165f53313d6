"""Block-FP8 checkpoints (DeepSeek-V3/R1, Qwen3-*-FP8; quant_method "fp8", transformers' FineGrainedFP8).

quantization_config: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [bn, bk] (128, 128), "modules_to_not_convert": [module names kept in bf16]}

    {p}.weight            float8_e4m3fn [N, K]
    {p}.weight_scale_inv  float32 [ceil(N/bn), ceil(K/bk)]   one scale a bn x bk tile; despite its name the
                                                              value is w * scale_inv (the dequantizing factor)
The canonical form keeps the scales row-wise: tile row n // bn repeated on each of its rows, group_size = bk.
Per-tensor FP8 (no weight_block_size, `weight_scale` scalars) is not read.
"""
from __future__ import annotations

import math

import torch

from cpumoe.loader.checkpoint import Checkpoint, CheckpointError
from cpumoe.loader.quantized.common import FLOATS, Layout, read_checked, unquantized_or_missing, validated
from cpumoe.quant.formats import FP8_BLOCK, QuantFormat, QuantizedWeight

METHOD = "fp8"


class BlockFp8(Layout):
    method = METHOD
    format = QuantFormat.FP8_W8A16

    def __init__(self, block_n: int = FP8_BLOCK, block_k: int = FP8_BLOCK):
        self.block_n, self.block_k = block_n, block_k

    @classmethod
    def from_config(cls, qc: dict, ckpt: Checkpoint) -> BlockFp8:
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise CheckpointError(f"{ckpt.path}: fp8 quantization_config needs weight_block_size [bn, bk] "
                                  f"(block FP8); got {block!r} (per-tensor FP8 is not supported)")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"{ckpt.path}: fp8 fmt {qc.get('fmt')!r} is not supported (e4m3)")
        return cls(*block)

    def read(self, ckpt: Checkpoint, prefix: str) -> QuantizedWeight | None:
        name = f"{prefix}.weight_scale_inv"
        if name not in ckpt:
            if f"{prefix}.weight" in ckpt and ckpt.dtype(f"{prefix}.weight") == torch.float8_e4m3fn:
                raise CheckpointError(f"tensor {name!r} not found in checkpoint {ckpt.path} (its weight is fp8)")
            return unquantized_or_missing(ckpt, prefix, name)
        q = read_checked(ckpt, f"{prefix}.weight", (torch.float8_e4m3fn,), (None, None))
        N, K = q.shape
        tiles = read_checked(ckpt, name, FLOATS, (math.ceil(N / self.block_n), math.ceil(K / self.block_k)))
        rows = tiles.float().repeat_interleave(self.block_n, dim=0)[:N].contiguous()  # [N, ceil(K/bk)]
        return validated(QuantizedWeight(self.format, q, rows, None, self.block_k), name)

    def write(self, prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        if qw.group_size != self.block_k:
            raise ValueError(f"{prefix}: fp8 k block {qw.group_size}, the layout's {self.block_k}")
        tiles = qw.scales[::self.block_n]  # [ceil(N/bn), ceil(K/bk)]
        if not torch.equal(tiles.repeat_interleave(self.block_n, dim=0)[:qw.shape[0]], qw.scales):
            raise ValueError(f"{prefix}: fp8 row scales are not constant over blocks of {self.block_n} rows")
        return {f"{prefix}.weight": qw.qweight, f"{prefix}.weight_scale_inv": tiles.float().contiguous()}

    def config(self, unquantized: list[str]) -> dict:
        return dict(quant_method=METHOD, fmt="e4m3", activation_scheme="dynamic",
                    weight_block_size=[self.block_n, self.block_k], modules_to_not_convert=list(unquantized))
