"""The C++ kernel paths (csrc/core): x86-avx512bf16, x86-avx512, x86-avx2, arm-bfmmla, arm-neon, generic.
One class serves them all; what each supports comes from the native library (compiled in? CPU features?
dtypes?), so the Python side never guesses."""
from __future__ import annotations

import torch

from cpumoe import ops
from cpumoe.experts.base import ExpertsConfig, ExpertsPath, PreparedExperts, check_common

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class NativeExperts(ExpertsPath):
    def __init__(self, name: str, unavailable: str, layout: str, rows_per_tile: int, dtypes: list[str]):
        self.name = name
        self.unavailable = unavailable
        self.layout = layout
        self.rows_per_tile = rows_per_tile
        self.dtypes = dtypes

    def is_supported(self, config: ExpertsConfig) -> tuple[bool, str]:
        if self.unavailable:
            return False, self.unavailable
        ok, why = check_common(config)
        if not ok:
            return ok, why
        dtype = _DTYPE_NAMES.get(config.dtype)
        if dtype not in self.dtypes:
            return False, f"takes {'/'.join(self.dtypes)} only, not {config.dtype}"
        return True, ""

    def prepare(self, w13, w2, w13_bias, w2_bias) -> PreparedExperts:
        return self._with_biases(ops.pack_w13(w13.contiguous(), self.name), ops.pack_w2(w2.contiguous(), self.name),
                                 w13_bias, w2_bias)

    @staticmethod
    def _with_biases(w13p, w2p, w13_bias, w2_bias) -> PreparedExperts:
        padded_inter = w13p.shape[1] * 32
        padded_hidden = w2p.shape[1] * 64
        return PreparedExperts(
            w13=w13p, w2=w2p,
            w13_bias=ops.pack_w13_bias(w13_bias, padded_inter) if w13_bias is not None else None,
            w2_bias=ops.pack_w2_bias(w2_bias, padded_hidden) if w2_bias is not None else None)

    def prepare_experts(self, num_experts, read_expert, w13_bias, w2_bias) -> PreparedExperts:
        packed13 = packed2 = None
        for e in range(num_experts):
            w13_e, w2_e = read_expert(e)
            p13 = ops.pack_w13(w13_e.unsqueeze(0).contiguous(), self.name)  # [1, blocks, elems]
            p2 = ops.pack_w2(w2_e.unsqueeze(0).contiguous(), self.name)
            if packed13 is None:
                packed13 = _empty_huge((num_experts, *p13.shape[1:]), p13.dtype)
                packed2 = _empty_huge((num_experts, *p2.shape[1:]), p2.dtype)
            packed13[e].copy_(p13[0])
            packed2[e].copy_(p2[0])
        return self._with_biases(packed13, packed2, w13_bias, w2_bias)

    def apply(self, prepared, config, hidden_states, topk_weights, topk_ids, expert_map):
        return ops.fused_experts(
            hidden_states.contiguous(), prepared.w13, prepared.w2, topk_weights.contiguous(),
            topk_ids.contiguous(), path=self.name, activation=config.activation, w13_bias=prepared.w13_bias,
            w2_bias=prepared.w2_bias, expert_map=expert_map,
            apply_router_weight_on_input=config.apply_router_weight_on_input)


def _empty_huge(shape, dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    ops._C.advise_huge_pages(t)  # before the first write chooses its pages
    return t


def native_paths() -> list[NativeExperts]:
    return [NativeExperts(name, why, layout, rows, list(dtypes))
            for name, why, layout, rows, dtypes in ops._C.kernel_paths()]
