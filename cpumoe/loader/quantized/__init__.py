"""Quantized checkpoints: the public layouts read as, and written from, cpumoe.quant's QuantizedWeight.

    qc = QuantizedCheckpoint(Checkpoint(path))     # the layout from config.json's quantization_config
    qc.format                                      # QuantFormat, or None for an unquantized checkpoint
    qc.linear("model.layers.0.self_attn.q_proj")  # QuantizedWeight [N, K], or None: read `<prefix>.weight`
    qc.expert("model.layers.0.mlp.experts", "gate_proj", 3)   # one expert [N, K] (or None), also for the
                                                   # fused gpt-oss tensors ("gate_up_proj": rows as on disk)

Layouts (quant_method -> class, module): the tensor names are in each module's docstring.
    compressed-tensors  CompressedTensors  int-quantized (int8_w8a8), pack-quantized (int4_w4a16),
                                           mxfp4-pack-quantized (mxfp4_w4a16)
    gptq                Gptq               int4_w4a16 (no act-order)
    awq                 Awq                int4_w4a16 (gemm)
    fp8                 BlockFp8           fp8_w8a16 (block FP8, weight_scale_inv)
    mxfp4               GptOssMxfp4        mxfp4_w4a16 (gpt-oss fused experts *_blocks / *_scales)
Errors (an unknown quant_method, a missing tensor, a wrong shape or dtype, a group size that does not divide K,
act-order) are CheckpointErrors naming the tensor. `cpumoe quantize` (convert.py) writes these layouts.
"""
from __future__ import annotations

from pathlib import Path

from cpumoe.loader.checkpoint import Checkpoint, CheckpointError
from cpumoe.loader.quantized.awq import Awq
from cpumoe.loader.quantized.common import Layout
from cpumoe.loader.quantized.compressed_tensors import CompressedTensors
from cpumoe.loader.quantized.fp8 import BlockFp8
from cpumoe.loader.quantized.gpt_oss_mxfp4 import GptOssMxfp4
from cpumoe.loader.quantized.gptq import Gptq
from cpumoe.quant.formats import QuantFormat, QuantizedWeight

LAYOUTS: dict[str, type[Layout]] = {cls.method: cls for cls in (CompressedTensors, Gptq, Awq, BlockFp8, GptOssMxfp4)}

__all__ = ["LAYOUTS", "QuantizedCheckpoint", "layout_of"]


def layout_of(ckpt: Checkpoint) -> Layout | None:
    """The layout config.json's quantization_config names (None: not quantized)."""
    qc = ckpt.config_get("quantization_config", default=None)
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in LAYOUTS:
        raise CheckpointError(f"{ckpt.path}: quantization_config quant_method {method!r} is not supported "
                              f"(supported: {', '.join(LAYOUTS)})")
    return LAYOUTS[method].from_config(qc, ckpt)


class QuantizedCheckpoint:
    def __init__(self, ckpt: Checkpoint | str | Path):
        self.ckpt = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint(ckpt)
        self.layout = layout_of(self.ckpt)

    @property
    def format(self) -> QuantFormat | None:
        return None if self.layout is None else self.layout.format

    @property
    def fused_experts(self) -> bool:
        """Experts stored as [E, ...] tensors (gpt-oss MXFP4)."""
        return bool(getattr(self.layout, "fused", False))

    def linear(self, prefix: str) -> QuantizedWeight | None:
        """The linear at module `prefix` as a QuantizedWeight [N, K] ([E, N, K] for fused experts), or None when it
        is stored unquantized (then `<prefix>.weight` holds it)."""
        return None if self.layout is None else self.layout.read(self.ckpt, prefix)

    def expert(self, prefix: str, projection: str, expert: int) -> QuantizedWeight | None:
        """Expert `expert`'s `projection` under the experts module `prefix` ("model.layers.0.mlp.experts"): the
        fused tensors `<prefix>.<projection>_blocks` (gpt-oss) or the per-expert `<prefix>.<e>.<projection>`."""
        if self.layout is None:
            return None
        if self.fused_experts:
            return self.layout.read_expert(self.ckpt, f"{prefix}.{projection}", expert)
        return self.layout.read(self.ckpt, f"{prefix}.{expert}.{projection}")

    def __repr__(self) -> str:
        method = None if self.layout is None else self.layout.method
        return f"QuantizedCheckpoint({str(self.ckpt.path)!r}, method={method!r}, format={self.format})"
