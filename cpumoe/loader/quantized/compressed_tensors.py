"""compressed-tensors checkpoints (llm-compressor; quant_method "compressed-tensors"), three of its formats.

quantization_config: {"quant_method": "compressed-tensors", "format": F, "quantization_status": "compressed",
  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {num_bits, type, symmetric, strategy,
  group_size, dynamic}, "input_activations": ... | null}}, "ignore": [module names kept in float]}

    format "int-quantized" (W8A8 int8: weights channel, activations dynamic per token):
        {p}.weight int8 [N, K], {p}.weight_scale float [N, 1]             value = q * s
    format "pack-quantized" (W4A16 int4, strategy group or channel):
        {p}.weight_packed int32 [N, ceil(K/8)]  q + 8 packed 8 a word along K, element i in bits 4i (pack_to_int32)
        {p}.weight_scale float [N, K/g], {p}.weight_shape int [2] = [N, K]
        {p}.weight_zero_point int32 [ceil(N/8), K/g]  (symmetric false only) z + 8 packed along N
        value = (q - z) * s, q and z in -8..7 (canonical codes and zeros are those + 8)
    format "mxfp4-pack-quantized" (MXFP4A16):
        {p}.weight_packed uint8 [N, K/2] e2m1 codes, low nibble first; {p}.weight_scale uint8 [N, K/32] e8m0

The tensor names and packing are compressed_tensors.compressors' (pack_quantized/helpers.py: pack_to_int32,
nvfp4/helpers.py: pack_fp4_to_uint8). Scales are written in float32 (compressed-tensors keeps any float dtype).
"""
from __future__ import annotations

import torch

from cpumoe.loader.checkpoint import Checkpoint, CheckpointError
from cpumoe.loader.quantized.common import (FLOATS, Layout, divides, read_checked, unquantized_or_missing,
                                             validated)
from cpumoe.loader.quantized.packing import pack_int32, pack_pairs, pad_to, unpack_int32, unpack_pairs
from cpumoe.quant.formats import MXFP4_GROUP, QuantFormat, QuantizedWeight

METHOD = "compressed-tensors"
INT8, PACKED, MXFP4 = "int-quantized", "pack-quantized", "mxfp4-pack-quantized"
FORMATS = {INT8: QuantFormat.INT8_W8A8, PACKED: QuantFormat.INT4_W4A16, MXFP4: QuantFormat.MXFP4_W4A16}


class CompressedTensors(Layout):
    method = METHOD

    def __init__(self, format: QuantFormat, group_size: int = 0, symmetric: bool = True):
        self.format, self.group_size, self.symmetric = format, group_size, symmetric
        self.strategy = "group"  # int4: "group" or "channel" (one group of K)

    @classmethod
    def from_config(cls, qc: dict, ckpt: Checkpoint) -> CompressedTensors:
        groups = qc.get("config_groups") or {}
        schemes = [g for g in groups.values() if isinstance(g, dict) and g.get("weights")]
        if not schemes:
            raise CheckpointError(f"{ckpt.path}: compressed-tensors quantization_config has no config_groups "
                                  "with weights")
        formats = {s.get("format") or qc.get("format") for s in schemes}
        weights = [s["weights"] for s in schemes]
        if len(formats) > 1 or any(w != weights[0] for w in weights):
            raise CheckpointError(f"{ckpt.path}: compressed-tensors with several weight schemes {weights} "
                                  "(mixed precision) is not supported")
        name, w = formats.pop(), weights[0]
        if name not in FORMATS:
            raise CheckpointError(f"{ckpt.path}: compressed-tensors format {name!r} is not supported "
                                  f"(supported: {', '.join(FORMATS)})")
        fmt = FORMATS[name]
        want = {QuantFormat.INT8_W8A8: (8, "int"), QuantFormat.INT4_W4A16: (4, "int"),
                QuantFormat.MXFP4_W4A16: (4, "float")}[fmt]
        if (w.get("num_bits"), w.get("type", "int")) != want:
            raise CheckpointError(f"{ckpt.path}: compressed-tensors {name} with {w.get('num_bits')}-bit "
                                  f"{w.get('type')} weights is not supported (expected {want[0]}-bit {want[1]})")
        if fmt is QuantFormat.INT8_W8A8 and (w.get("strategy") not in ("channel", "tensor")
                                             or not w.get("symmetric", True)):
            raise CheckpointError(f"{ckpt.path}: int-quantized weights must be symmetric per channel or tensor, "
                                  f"got strategy {w.get('strategy')!r} symmetric {w.get('symmetric')}")
        layout = cls(fmt, int(w.get("group_size") or 0), bool(w.get("symmetric", True)))
        layout.strategy = w.get("strategy") or "group"
        if fmt is QuantFormat.INT4_W4A16 and layout.strategy not in ("group", "channel"):
            raise CheckpointError(f"{ckpt.path}: pack-quantized strategy {layout.strategy!r} is not supported "
                                  "(group or channel)")
        return layout

    # --- reading ------------------------------------------------------------------------------------------------
    def read(self, ckpt: Checkpoint, prefix: str) -> QuantizedWeight | None:
        if self.format is QuantFormat.INT8_W8A8:
            if f"{prefix}.weight_scale" not in ckpt:
                return unquantized_or_missing(ckpt, prefix, f"{prefix}.weight_scale")
            q = read_checked(ckpt, f"{prefix}.weight", (torch.int8,), (None, None))
            N, K = q.shape
            s = read_checked(ckpt, f"{prefix}.weight_scale", FLOATS).float()
            if tuple(s.shape) in ((N, 1), (N,)):
                s = s.reshape(N)
            elif s.numel() == 1 and self.strategy == "tensor":
                s = s.reshape(1).expand(N).contiguous()
            else:
                raise CheckpointError(f"tensor {prefix + '.weight_scale'!r} has shape {list(s.shape)}, expected "
                                      f"[{N}, 1]")
            return QuantizedWeight(self.format, q, s.contiguous(), None, K)
        if f"{prefix}.weight_packed" not in ckpt:
            return unquantized_or_missing(ckpt, prefix, f"{prefix}.weight_packed")
        if self.format is QuantFormat.MXFP4_W4A16:
            packed = read_checked(ckpt, f"{prefix}.weight_packed", (torch.uint8,), (None, None))
            N, K = packed.shape[0], packed.shape[1] * 2
            divides(MXFP4_GROUP, K, f"{prefix}.weight_packed")
            s = read_checked(ckpt, f"{prefix}.weight_scale", (torch.uint8,), (N, K // MXFP4_GROUP))
            return QuantizedWeight(self.format, unpack_pairs(packed), s, None, MXFP4_GROUP)
        return self._read_int4(ckpt, prefix)

    def _read_int4(self, ckpt: Checkpoint, prefix: str) -> QuantizedWeight:
        shape = read_checked(ckpt, f"{prefix}.weight_shape", (torch.int64, torch.int32), (2,)).tolist()
        N, K = shape
        words = (K + 7) // 8
        packed = read_checked(ckpt, f"{prefix}.weight_packed", (torch.int32,), (N, words))
        g = K if self.strategy == "channel" else self.group_size
        divides(g, K, f"{prefix}.weight_packed")
        s = read_checked(ckpt, f"{prefix}.weight_scale", FLOATS, (N, K // g)).float()
        zeros = None
        if not self.symmetric:
            name = f"{prefix}.weight_zero_point"
            if name in ckpt and ckpt.dtype(name) == torch.int8:  # older compressed-tensors: unpacked, -8..7
                zeros = (read_checked(ckpt, name, (torch.int8,), (N, K // g)).to(torch.int16) + 8).to(torch.uint8)
            else:
                zp = read_checked(ckpt, name, (torch.int32,), ((N + 7) // 8, K // g), what="zero point")
                zeros = unpack_int32(zp, dim=0)[:N]
        codes = unpack_int32(packed, dim=1)[:, :K]
        return validated(QuantizedWeight(self.format, codes, s.contiguous(), zeros, g), f"{prefix}.weight_packed")

    # --- writing ------------------------------------------------------------------------------------------------
    def accepts(self, N: int, K: int) -> str:
        g = MXFP4_GROUP if self.format is QuantFormat.MXFP4_W4A16 else self.group_size
        if self.format is not QuantFormat.INT8_W8A8 and K % g:
            return f"group size {g} does not divide K={K}"
        return ""

    def write(self, prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        if self.format is QuantFormat.INT8_W8A8:
            return {f"{prefix}.weight": qw.qweight, f"{prefix}.weight_scale": qw.scales[:, None].contiguous()}
        if self.format is QuantFormat.MXFP4_W4A16:
            return {f"{prefix}.weight_packed": pack_pairs(qw.qweight), f"{prefix}.weight_scale": qw.scales}
        N, K = qw.shape
        out = {f"{prefix}.weight_packed": pack_int32(pad_to(qw.qweight, 1, 8), dim=1),
               f"{prefix}.weight_scale": qw.scales,
               f"{prefix}.weight_shape": torch.tensor([N, K], dtype=torch.int64)}
        if qw.zeros is not None:
            out[f"{prefix}.weight_zero_point"] = pack_int32(pad_to(qw.zeros, 0, 8), dim=0)
        return out

    def config(self, unquantized: list[str]) -> dict:
        if self.format is QuantFormat.INT8_W8A8:
            fmt = INT8
            weights = dict(num_bits=8, type="int", symmetric=True, group_size=None, strategy="channel",
                           dynamic=False)
            acts = dict(num_bits=8, type="int", symmetric=True, group_size=None, strategy="token", dynamic=True)
        elif self.format is QuantFormat.INT4_W4A16:
            fmt, acts = PACKED, None
            weights = dict(num_bits=4, type="int", symmetric=self.symmetric, group_size=self.group_size,
                           strategy="group", dynamic=False)
        else:
            fmt, acts = MXFP4, None
            weights = dict(num_bits=4, type="float", symmetric=True, group_size=MXFP4_GROUP, strategy="group",
                           dynamic=False, scale_dtype="torch.uint8")
        group = dict(targets=["Linear"], weights=weights, input_activations=acts, output_activations=None,
                     format=fmt)
        return dict(quant_method=METHOD, format=fmt, quantization_status="compressed",
                    config_groups={"group_0": group}, ignore=list(unquantized), kv_cache_scheme=None,
                    global_compression_ratio=None)

