"""gpt-oss MXFP4 checkpoints (openai/gpt-oss-20b, -120b; quant_method "mxfp4"): only the fused experts.

quantization_config (the published one): {"quant_method": "mxfp4", "modules_to_not_convert":
  ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}

    {p}_blocks  uint8 [E, N, K/32, 16]  e2m1 codes, column 32 b + 2 j in the low nibble of byte j, 2 j + 1 high
    {p}_scales  uint8 [E, N, K/32]      e8m0 exponents (bias 127)
with p = model.layers.{i}.mlp.experts.gate_up_proj (N = 2I, gate/up rows interleaved as on disk) or .down_proj
(N = H). Read one expert at a time (`read_expert`); rows stay in the on-disk order. Unquantized gpt-oss stores
`{p}` itself, [E, K, N] (transposed). See cpumoe/loader/mxfp4.py for the format.
"""
from __future__ import annotations

import torch

from cpumoe.loader.checkpoint import Checkpoint, CheckpointError
from cpumoe.loader.quantized.common import Layout, divides, read_checked
from cpumoe.loader.quantized.packing import pack_pairs, unpack_pairs
from cpumoe.quant.formats import MXFP4_GROUP, QuantFormat, QuantizedWeight

METHOD = "mxfp4"
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
BYTES = MXFP4_GROUP // 2


class GptOssMxfp4(Layout):
    method = METHOD
    format = QuantFormat.MXFP4_W4A16
    fused = True  # [E, ...] tensors: experts are read with read_expert

    @classmethod
    def from_config(cls, qc: dict, ckpt: Checkpoint) -> GptOssMxfp4:
        return cls()

    def read(self, ckpt: Checkpoint, prefix: str) -> QuantizedWeight | None:
        """All experts [E, N, K] (read_expert reads one)."""
        return self._read(ckpt, prefix, None)

    def read_expert(self, ckpt: Checkpoint, prefix: str, expert: int) -> QuantizedWeight | None:
        return self._read(ckpt, prefix, expert)

    def _read(self, ckpt: Checkpoint, prefix: str, expert: int | None) -> QuantizedWeight | None:
        blocks_name, scales_name = f"{prefix}_blocks", f"{prefix}_scales"
        if blocks_name not in ckpt:
            if prefix in ckpt or f"{prefix}.weight" in ckpt:
                return None
            raise CheckpointError(f"MXFP4 tensor {blocks_name!r} not found in checkpoint {ckpt.path}")
        shape = tuple(ckpt.shape(blocks_name))
        if len(shape) != 4 or shape[-1] != BYTES:
            raise CheckpointError(f"MXFP4 tensor {blocks_name!r} in {ckpt.path} has shape {list(shape)}, expected "
                                  f"[E, N, K/32, {BYTES}]")
        E, N, G = shape[:3]
        if expert is not None and not 0 <= expert < E:
            raise CheckpointError(f"MXFP4 tensor {blocks_name!r} has {E} experts, no expert {expert}")
        lead = () if expert is not None else (E,)
        blocks = read_checked(ckpt, blocks_name, (torch.uint8,), index=expert)
        scales = read_checked(ckpt, scales_name, (torch.uint8,), (*lead, N, G), what="MXFP4", index=expert)
        codes = unpack_pairs(blocks.flatten(-2))  # [.., N, K]
        return QuantizedWeight(self.format, codes, scales, None, MXFP4_GROUP)

    def accepts(self, N: int, K: int) -> str:
        return "" if K % MXFP4_GROUP == 0 else f"K={K} is not a multiple of {MXFP4_GROUP}"

    def write(self, prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        divides(MXFP4_GROUP, qw.shape[-1], prefix)
        blocks = pack_pairs(qw.qweight).unflatten(-1, (-1, BYTES))  # [E, N, K/32, 16]
        return {f"{prefix}_blocks": blocks.contiguous(), f"{prefix}_scales": qw.scales}

    def config(self, unquantized: list[str]) -> dict:
        return dict(quant_method=METHOD, modules_to_not_convert=list(NOT_CONVERTED))
