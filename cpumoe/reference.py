"""Plain PyTorch references: the maths every kernel backend must reproduce.

The MoE layer here is the "before" picture: route, loop over experts, w13 GEMM, activation, w2 GEMM,
weighted combine. It computes in float32 but copies the kernels' rounding: the activation output is
rounded to the input dtype before the w2 GEMM (the kernels keep the intermediate in that dtype), inputs
scaled by the router weight (apply_router_weight_on_input) are rounded likewise, and the output is
rounded once at the end.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cpumoe.routing import select_experts  # noqa: F401  (the routing reference is the router itself)

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def activate(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up, in the dtype given (callers pass float32)."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swigluoai":  # gpt-oss: clamped gate and up, alpha-scaled sigmoid, (up + 1)
        gate = gate.clamp(max=SWIGLUOAI_LIMIT)
        up = up.clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
        return gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA) * (up + 1)
    raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
                  apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """hidden_states [M, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I] -> [M, H] in the input dtype.

    topk_ids [M, k] are global expert ids; expert_map [E_global] maps them to rows of w13/w2 (-1: expert not
    on this shard, contributes nothing).
    """
    dtype = hidden_states.dtype
    M, k = topk_ids.shape
    inter = w2.shape[2]
    x = hidden_states
    if apply_router_weight_on_input:
        x = (x.float() * topk_weights.float()).to(dtype)  # k == 1
    local_ids = expert_map[topk_ids.long()] if expert_map is not None else topk_ids.long()  # [M, k]
    out = torch.zeros(M, k, w2.shape[1], dtype=torch.float32)
    for e in range(w13.shape[0]):
        tokens, slots = torch.nonzero(local_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = x[tokens].float() @ w13[e].float().T  # [T, 2I]
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        a = activate(h[:, :inter], h[:, inter:], activation).to(dtype)  # the kernels' intermediate dtype
        y = a.float() @ w2[e].float().T  # [T, H]
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        if not apply_router_weight_on_input:
            y = y * topk_weights[tokens, slots].float()[:, None]
        out[tokens, slots] = y
    return out.sum(dim=1).to(dtype)  # [M, H]


def quantized_fused_experts(hidden_states: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                            *, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                            w2_bias: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
                            apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """fused_experts over quantized weights (cpumoe.quant.QuantizedWeight stacks w13 [E, 2I, H], w2 [E, H, I]).

    Weights are dequantized to float32. int8_w8a8, int4_w4a16 and mxfp4_w4a16 (A8) also quantize the
    activations as the kernels do: each token's input row per token before w13, each (token, slot)
    intermediate row (kept in float32) before w2, with cpumoe.quant.quantize_activations. fp8 (A16) keeps
    bf16 activations and rounds the intermediate to bf16, like the unquantized kernels."""
    from cpumoe.quant import dequantize, quantize_activations  # reference -> quant: quant imports no reference

    dtype = hidden_states.dtype
    a8 = w13.format.int8_activations
    M, k = topk_ids.shape
    w13f, w2f = dequantize(w13), dequantize(w2)
    inter = w2f.shape[2]
    x = hidden_states
    if apply_router_weight_on_input:
        x = (x.float() * topk_weights.float()).to(dtype)
    if a8:
        q, s = quantize_activations(x)
        x = q.float() * s[:, None]
    local_ids = expert_map[topk_ids.long()] if expert_map is not None else topk_ids.long()
    out = torch.zeros(M, k, w2f.shape[1], dtype=torch.float32)
    for e in range(w13f.shape[0]):
        tokens, slots = torch.nonzero(local_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = x[tokens].float() @ w13f[e].T
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        a = activate(h[:, :inter], h[:, inter:], activation)
        if a8:
            qa, sa = quantize_activations(a)
            a = qa.float() * sa[:, None]
        else:
            a = a.to(dtype).float()
        y = a @ w2f[e].T
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        if not apply_router_weight_on_input:
            y = y * topk_weights[tokens, slots].float()[:, None]
        out[tokens, slots] = y
    return out.sum(dim=1).to(dtype)


def quantized_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized weight [N, K]^T (+ bias), activations quantized per token for the A8 formats."""
    from cpumoe.quant import dequantize, quantize_activations

    x2 = x.reshape(-1, x.shape[-1])
    if weight.format.int8_activations:
        q, s = quantize_activations(x2)
        xf = q.float() * s[:, None]
    else:
        xf = x2.float()
    y = xf @ dequantize(weight).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)
