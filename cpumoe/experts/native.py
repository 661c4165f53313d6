"""The C++ kernel backends (csrc/core): x86-avx512bf16, x86-avx512vnni, x86-avx512, x86-avx2, arm-bfmmla, arm-i8mm,
arm-dotprod, arm-neon, generic. One class serves them all; what each supports (compiled in? CPU features? dtypes?
quantized formats?) comes from the native library, so the Python side never guesses."""
from __future__ import annotations

import torch

from cpumoe import ops
from cpumoe.experts.base import ExpertsBackend, ExpertsConfig, PreparedExperts, check_common
from cpumoe.quant import QuantFormat, QuantizedWeight

# Backends whose sums for a row depend on the call's row count: x86-amx runs calls of enough rows on AMX tiles
# (4 for bf16 and fp8, 16 for int4 and mxfp4) and fewer on the AVX-512 tiles, whose bf16, fp8 and mxfp4 sums add up
# a row's products in another order (its int8 and int4 sums are exact and give the same bits either way).
ROW_COUNT_DEPENDENT = frozenset({"x86-amx"})

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class NativeExperts(ExpertsBackend):
    def __init__(self, name: str, unavailable: str, layout: str, rows_per_tile: int, dtypes: list[str],
                 formats: list[str]):
        self.name = name
        self.rows_independent = name not in ROW_COUNT_DEPENDENT
        self.unavailable = unavailable
        self.layout = layout
        self.rows_per_tile = rows_per_tile
        self.dtypes = dtypes
        self.formats = formats

    def is_supported(self, config: ExpertsConfig) -> tuple[bool, str]:
        if self.unavailable:
            return False, self.unavailable
        ok, why = check_common(config)
        if not ok:
            return ok, why
        if config.quantization != "none":
            return self._supports_format(config)
        if not self.dtypes:
            return False, "has no unquantized tiles (quantized formats only)"
        dtype = _DTYPE_NAMES.get(config.dtype)
        if dtype not in self.dtypes:
            return False, f"takes {'/'.join(self.dtypes)} only, not {config.dtype}"
        return True, ""

    def _supports_format(self, config: ExpertsConfig) -> tuple[bool, str]:
        fmt = QuantFormat(config.quantization)
        if fmt.value not in self.formats:
            return False, f"has no {fmt.value} tiles" + (f" (has {', '.join(self.formats)})" if self.formats else "")
        if not fmt.int8_activations and config.dtype != torch.bfloat16:
            return False, f"{fmt.value} takes bfloat16 activations, not {config.dtype}"
        if config.dtype not in _DTYPE_NAMES:
            return False, f"activations must be float32/bfloat16/float16, not {config.dtype}"
        return True, ""

    def prepare(self, w13, w2, w13_bias, w2_bias) -> PreparedExperts:
        return self._with_biases(ops.pack_w13(w13.contiguous(), self.name), ops.pack_w2(w2.contiguous(), self.name),
                                 w13_bias, w2_bias)

    @staticmethod
    def _with_biases(w13p, w2p, w13_bias, w2_bias, **extra) -> PreparedExperts:
        padded_inter = w13p.shape[1] * 32
        padded_hidden = w2p.shape[1] * 64
        return PreparedExperts(
            w13=w13p, w2=w2p,
            w13_bias=ops.pack_w13_bias(w13_bias, padded_inter) if w13_bias is not None else None,
            w2_bias=ops.pack_w2_bias(w2_bias, padded_hidden) if w2_bias is not None else None, extra=extra)

    def prepare_experts(self, num_experts, read_expert, w13_bias, w2_bias) -> PreparedExperts:
        def pack(e):
            w13_e, w2_e = read_expert(e)
            return (ops.pack_w13(w13_e.unsqueeze(0).contiguous(), self.name),  # [1, blocks, elems]
                    ops.pack_w2(w2_e.unsqueeze(0).contiguous(), self.name))
        packed13, packed2 = _pack_each(num_experts, pack)
        return self._with_biases(packed13, packed2, w13_bias, w2_bias)

    def prepare_quantized(self, config, w13, w2, w13_bias, w2_bias) -> PreparedExperts:
        group = config.group_size
        return self._with_biases(_pack_quant(w13, group, w13=True), _pack_quant(w2, group, w13=False), w13_bias,
                                 w2_bias)

    def prepare_quantized_experts(self, config, num_experts, read_expert, w13_bias, w2_bias) -> PreparedExperts:
        def pack(e):
            w13_e, w2_e = read_expert(e)
            return (_pack_quant(w13_e, config.group_size, w13=True), _pack_quant(w2_e, config.group_size, w13=False))
        packed13, packed2 = _pack_each(num_experts, pack)
        return self._with_biases(packed13, packed2, w13_bias, w2_bias)

    def apply(self, prepared, config, hidden_states, topk_weights, topk_ids, expert_map):
        common = dict(activation=config.activation, w13_bias=prepared.w13_bias, w2_bias=prepared.w2_bias,
                      expert_map=expert_map, apply_router_weight_on_input=config.apply_router_weight_on_input)
        if config.quantization != "none":
            return ops.fused_experts_quant(
                hidden_states.contiguous(), prepared.w13, prepared.w2, topk_weights.contiguous(),
                topk_ids.contiguous(), backend=self.name, format=config.quantization, group_size=config.group_size,
                **common)
        return ops.fused_experts(hidden_states.contiguous(), prepared.w13, prepared.w2, topk_weights.contiguous(),
                                 topk_ids.contiguous(), backend=self.name, **common)

    def bind_routed(self, prepared, config, num_experts, routing, expert_map):
        if routing["num_expert_group"] is not None:  # grouped routing runs in torch ops (select_experts)
            return None
        return ops._C.RoutedExperts(
            prepared.w13, prepared.w2, config.hidden_size, config.dtype, num_experts, config.top_k, routing["scoring"],
            routing["renormalize"], routing["e_score_correction_bias"], routing["routed_scaling_factor"], self.name,
            config.quantization, config.group_size, config.activation, prepared.w13_bias, prepared.w2_bias,
            expert_map, config.apply_router_weight_on_input)


def _pack_quant(w: QuantizedWeight, group: int, *, w13: bool) -> torch.Tensor:
    """A QuantizedWeight [E, N, K] or [N, K] -> packed blocks [E, blocks, bytes]."""
    lead = w.qweight.dim() == 2
    unsq = (lambda t: None if t is None else t.unsqueeze(0).contiguous()) if lead else \
        (lambda t: None if t is None else t.contiguous())
    return ops.pack_quant(unsq(w.qweight), unsq(w.scales), unsq(w.zeros), format=w.format.value, group_size=group,
                          w13=w13)


def _pack_each(num_experts: int, pack) -> tuple[torch.Tensor, torch.Tensor]:
    """Packs expert by expert (pack(e) -> ([1, ...], [1, ...])) into two stacks allocated on the first."""
    packed13 = packed2 = None
    for e in range(num_experts):
        p13, p2 = pack(e)
        if packed13 is None:
            packed13 = ops._C.empty_packed_stack(p13, num_experts)
            packed2 = ops._C.empty_packed_stack(p2, num_experts)
        packed13[e].copy_(p13[0])
        packed2[e].copy_(p2[0])
    return packed13, packed2


def native_backends() -> list[NativeExperts]:
    return [NativeExperts(name, why, layout, rows, list(dtypes), list(formats))
            for name, why, layout, rows, dtypes, formats in ops._C.kernel_backends()]
