"""A decoder layer's decode step as one C++ call (csrc/torch/decode_layer.inc): the layer's ops, in the order and
on the tensors its modules give them, without the Python and the dispatches between them. Bit for bit what the
modules compute; decode steps only (every sequence one token).

    fused_decode_layer(layer) -> (ops.DecodeLayer, None) where the layer is the plain pre-norm attention + MoE
                                 layer on native kernels, else (None, why not)

The model (causal_lm.DecoderModel) runs a step through these when every layer has one and the step is all decodes;
other steps, and models with other layers, run the modules. Built once per layer after loading, so it holds the
packed weights the modules hold (the same tensors, not copies).
"""
from __future__ import annotations

from torch import nn

from cpumoe import ops
from cpumoe.experts.native import NativeExperts
from cpumoe.models.architecture import DecoderLayer
from cpumoe.models.blocks import Attention, MoEBlock, QKNorm, RMSNorm
from cpumoe.models.packed_linear import PackedLinear, QuantizedLinear


def fused_decode_layer(layer: nn.Module) -> tuple[object | None, str | None]:
    """(ops.DecodeLayer over layer's weights, None), or (None, why the layer runs as modules)."""
    if type(layer) is not DecoderLayer or not layer.adds_in_norms:
        return None, f"{type(layer).__name__} is not the plain pre-norm decoder layer"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not RMSNorm or n.weight_in_float for n in norms) or norms[0].eps != norms[1].eps:
        return None, "its norms are not two RMSNorms of one epsilon, rounded before the weight"
    attn, mlp = layer.self_attn, layer.get_submodule(layer.mlp_name)
    why = _attention_why_not(attn) or _moe_why_not(mlp)
    if why:
        return None, why
    dtype = mlp.experts.config.dtype  # the activations'
    if any(n.weight.dtype != dtype for n in norms):  # the modules then run torch's maths (RMSNorm._runs_op)
        return None, f"its norm weights are not in the activations' {dtype}"
    head_norms = attn._fused_head_norms(dtype) if attn.qk_norm == QKNorm.HEAD else (None, None)
    if head_norms is None:
        return None, "its q/k norms round differently from ops.rope_and_cache's"
    experts = mlp.experts
    quantized = experts.config.quantization != "none"
    plan = ops.DecodeLayer(
        input_norm=norms[0].weight.detach(), post_norm=norms[1].weight.detach(), eps=norms[0].eps,
        qkv=_layer_linear(attn.qkv_proj), q_norm=head_norms[0], k_norm=head_norms[1],
        head_norm_eps=attn.q_norm.eps if head_norms[0] is not None else 1e-6,
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        scale=attn.head_dim ** -0.5, attention_backend="", o=_layer_linear(attn.o_proj),
        router=_layer_linear(mlp.gate), top_k=experts.top_k, scoring=experts.routing["scoring"],
        renormalize=experts.routing["renormalize"], w13=experts.prepared.w13, w2=experts.prepared.w2,
        experts_backend=experts.impl.name, experts_format=experts.config.quantization if quantized else "",
        experts_group_size=experts.config.group_size, activation=experts.config.activation)
    return plan, None


def _attention_why_not(attn: nn.Module) -> str | None:
    if type(attn) is not Attention:
        return f"its attention is {type(attn).__name__}"
    if attn.qkv_proj is None:
        return "its q/k/v projections are not joined into one GEMM"
    if attn.qk_norm == QKNorm.FULL or attn.clip_qkv is not None:
        return "its q/k are normed over the whole projection or clipped"
    if attn.sinks is not None or attn.sliding_window is not None:
        return "its attention has sinks or a sliding window"
    if not all(_is_packed(p) for p in (attn.qkv_proj, attn.o_proj)):
        return "a projection is not a packed cpumoe linear"
    return None


def _moe_why_not(mlp: nn.Module) -> str | None:
    if type(mlp) is not MoEBlock or mlp.shared_expert is not None:
        return f"its MLP is {type(mlp).__name__}" + (" with a shared expert" if type(mlp) is MoEBlock else "")
    experts = mlp.experts
    if experts is None or not isinstance(experts.impl, NativeExperts) or not _is_packed(mlp.gate) \
            or mlp.gate.bias is not None:
        return "its experts or router do not run on cpumoe's native kernels"
    r = experts.routing  # the C++ layer routes by ops.route: plain top-k over softmax or sigmoid scores
    if r["num_expert_group"] is not None or r["topk_group"] is not None or r["e_score_correction_bias"] is not None \
            or r["routed_scaling_factor"] != 1.0 or experts.expert_map is not None:
        return "its routing has expert groups, a score bias, a scaling factor or an expert map"
    if experts.config.has_bias or experts.config.apply_router_weight_on_input:
        return "its experts have biases or take the router weight on their input"
    return None


def _is_packed(linear: nn.Module) -> bool:
    return isinstance(linear, (PackedLinear, QuantizedLinear)) and linear.packed_weight is not None


def _layer_linear(linear: PackedLinear | QuantizedLinear):
    quantized = isinstance(linear, QuantizedLinear)
    return ops.LayerLinear(weight=linear.packed_weight, bias=None if linear.bias is None else linear.bias.detach(),
                           backend=linear.backend, format=linear.format.value if quantized else "",
                           group_size=linear.group_size if quantized else 0, out_features=linear.out_features)
