"""Quantized weight formats: one in-memory form (formats.py), a quantizer and dequantizer per format
(schemes.py). Kernels: csrc/core/quant.h; checkpoint layouts: cpumoe.loader.quantized."""
from cpumoe.quant.formats import (ALIASES, FP8_BLOCK, MXFP4_GROUP, QuantFormat, QuantizedWeight, concat_rows,
                                  parse_format, stack)
from cpumoe.quant.schemes import dequantize, quantize, quantize_activations

__all__ = ["ALIASES", "FP8_BLOCK", "MXFP4_GROUP", "QuantFormat", "QuantizedWeight", "concat_rows", "dequantize",
           "parse_format", "quantize", "quantize_activations", "stack"]
