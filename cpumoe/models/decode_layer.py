"""A decoder layer's decode step as one C++ call (csrc/torch/decode_layer.inc): the layer's ops, in the order and
on the tensors its modules give them, without the Python and the dispatches between them. Bit for bit what the
modules compute; decode steps only (every sequence one token).

    fused_decode_layer(layer) -> (ops.DecodeLayer, None) where the layer is the plain pre-norm attention + MoE
                                 layer on native kernels, else (None, why not)

    FusedDecodeStep.build(model) -> (the whole step: embedding, these layers, the final norm and the lm_head as one
                                     C++ call, ops.DecodeModel; None) or (None, why not)

The model (causal_lm.CausalLM) runs a step through the whole-step call when it has one and the step is all decodes,
else through these layers (causal_lm.DecoderModel) when every layer has one; other steps, and models with other
layers, run the modules. Built once after loading, so they hold the packed weights the modules hold (the same
tensors, not copies).
"""
from __future__ import annotations

import torch
from torch import nn

from cpumoe import ops
from cpumoe.attention import AttentionContext, DecodeBatch
from cpumoe.experts.native import NativeExperts
from cpumoe.models.architecture import Architecture, DecoderLayer
from cpumoe.models.blocks import Attention, MoEBlock, QKNorm, RMSNorm, RotaryEmbedding
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


class FusedDecodeStep:
    """A decode step of the whole model as one C++ call (csrc/torch/decode_model.inc) over the fused layers: from
    input ids to float32 logits, or to the final norm's output when the lm_head or the logits' last step is not one
    it runs (then the model's compute_logits takes it from there)."""

    def __init__(self, model: nn.Module, rotaries: list[RotaryEmbedding], rotary_of_layer: list[int],
                 lm_head: nn.Module | None):
        decoder = model.model
        self.decoder, self.rotaries, self.runs_lm_head = decoder, rotaries, lm_head is not None
        self.dtype = decoder.embed_tokens.weight.dtype
        self.layer_indices = [layer.layer_idx for layer in decoder.layers]
        self.plan = ops.DecodeModel(
            embedding=decoder.embed_tokens.weight.detach(), layers=decoder.decode_layers,
            rotary_of_layer=rotary_of_layer, final_norm=decoder.norm.weight.detach(), eps=decoder.norm.eps,
            weight_in_float=decoder.norm.weight_in_float, lm_head=None if lm_head is None else _layer_linear(lm_head))

    @classmethod
    def build(cls, model: nn.Module) -> tuple[FusedDecodeStep | None, str | None]:
        """(the step, None) where model's decode layers are fused and its embedding and final norm are the plain
        ones; else (None, why not)."""
        decoder = model.model
        if getattr(decoder, "decode_layers", None) is None:
            return None, "its layers do not run fused"
        embed, norm = decoder.embed_tokens, decoder.norm
        if type(embed) is not nn.Embedding:
            return None, f"its embedding is {type(embed).__name__}"
        if type(norm) is not RMSNorm or not norm._runs_op(embed.weight):  # else add_and_norm runs torch's maths
            return None, "its final norm is not an RMSNorm in the embeddings' dtype"
        rotaries, rotary_of_layer, keys = [], [], {}
        for layer in decoder.layers:
            rotary = layer.self_attn.rotary
            if type(rotary) is not RotaryEmbedding:
                return None, f"a layer's rotary is {type(rotary).__name__}"
            if rotary.cache_key not in keys:  # equal keys give equal tables (RotaryEmbedding.for_step shares them)
                keys[rotary.cache_key] = len(rotaries)
                rotaries.append(rotary)
            rotary_of_layer.append(keys[rotary.cache_key])
        plain_logits = type(model.arch).final_logits is Architecture.final_logits
        lm_head = model.lm_head if plain_logits and model.lm_head is not None and _is_packed(model.lm_head) else None
        return cls(model, rotaries, rotary_of_layer, lm_head), None

    def forward(self, input_ids: torch.Tensor, context: AttentionContext, decode: DecodeBatch) -> torch.Tensor:
        """input_ids [S] (each sequence's one new token) -> float32 logits [S, V], or the final hidden states [S, H]
        when not runs_lm_head."""
        length = max(context.context_lens)
        tables = [rotary.tables(self.dtype, length) for rotary in self.rotaries]
        caches = [context.kv_caches[i] for i in self.layer_indices]
        out = self.plan.forward(input_ids, context.positions, context.slot_mapping, [k for k, _ in caches],
                                [v for _, v in caches], decode.block_table, decode.key_begin, decode.key_end,
                                [cos for cos, _ in tables], [sin for _, sin in tables])
        for layer in self.decoder.decode_layers if self.decoder.decode_routing_hooks else ():
            for hook in self.decoder.decode_routing_hooks:
                hook(layer.routed_ids())
        return out
