"""The naive backend: a per-expert Python loop of PyTorch GEMMs in the input dtype, as a plain `nn.Module` MoE
block runs it (transformers' eager experts). It is the baseline the fused kernels are measured against and
the last resort of the oracle. Quantized layers run here on weights dequantized at load to the activation dtype
(no activation quantization): the "dequantize and run dense" baseline."""
from __future__ import annotations

import torch

from cpumoe import torch_gemm
from cpumoe.experts.base import ExpertsBackend, ExpertsConfig, PreparedExperts, check_common
from cpumoe.quant import QuantizedWeight, dequantize
from cpumoe.reference import activate


class NaiveExperts(ExpertsBackend):
    name = "naive"

    def is_supported(self, config: ExpertsConfig) -> tuple[bool, str]:
        return check_common(config)

    def prepare(self, w13, w2, w13_bias, w2_bias) -> PreparedExperts:
        return PreparedExperts(w13=w13.contiguous(), w2=w2.contiguous(), w13_bias=w13_bias, w2_bias=w2_bias)

    def prepare_quantized(self, config, w13, w2, w13_bias, w2_bias) -> PreparedExperts:
        return self.prepare(_dequantize_experts(w13, config.dtype), _dequantize_experts(w2, config.dtype), w13_bias,
                            w2_bias)

    def apply(self, prepared, config, hidden_states, topk_weights, topk_ids, expert_map):
        x = hidden_states
        if config.apply_router_weight_on_input:
            x = x * topk_weights.to(x.dtype)
        local_ids = expert_map[topk_ids.long()] if expert_map is not None else topk_ids.long()  # [M, k]
        out = torch.zeros(x.shape, dtype=torch.float32)
        inter = prepared.w2.shape[2]
        for e in torch.unique(local_ids).tolist():
            if e < 0:
                continue
            tokens, slots = torch.nonzero(local_ids == e, as_tuple=True)
            h = torch_gemm.linear(x[tokens], prepared.w13[e],
                                  prepared.w13_bias[e] if prepared.w13_bias is not None else None)  # [T, 2I]
            a = activate(h[:, :inter].float(), h[:, inter:].float(), config.activation).to(x.dtype)
            y = torch_gemm.linear(a, prepared.w2[e], prepared.w2_bias[e] if prepared.w2_bias is not None else None)
            if not config.apply_router_weight_on_input:
                y = y.float() * topk_weights[tokens, slots, None]
            out.index_add_(0, tokens, y.float())
        return out.to(x.dtype)


DEQUANTIZE_CHUNK = 8  # experts at a time: dequantize's float32 temporaries are several times the weights' size


def _dequantize_experts(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A stack [E, N, K] dequantized into `dtype`, DEQUANTIZE_CHUNK experts at a time (a whole Qwen3-30B layer at
    once would need ~10 GB of temporaries)."""
    out = torch.empty(w.shape, dtype=dtype)
    for e in range(0, w.shape[0], DEQUANTIZE_CHUNK):
        out[e:e + DEQUANTIZE_CHUNK] = dequantize(w[e:e + DEQUANTIZE_CHUNK])
    return out
