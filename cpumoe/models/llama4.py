"""Llama 4 (meta-llama/Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E), as transformers' Llama4ForCausalLM.
model_type "llama4_text" is the text model; "llama4" (Llama4ForConditionalGeneration, the published checkpoints)
has it under text_config and language_model.*: that text model is loaded, its vision tower and projector skipped.

    input_ids -> embed -> N x [x += attn(norm(x)); x += feed_forward(norm(x))] -> norm -> lm_head -> logits

Where it departs from the shared decoder:
- RoPE rotates interleaved channel pairs (x[2i], x[2i + 1]) (transformers multiplies complex numbers). Queries and
  keys are de-interleaved after their projections ([even channels, odd channels]), which makes it the rotate-half
  RoPE of blocks.py: q.k does not change when both sides are permuted alike (the cache holds permuted keys);
- two kinds of layer, by no_rope_layers[l] (1: RoPE, 0: NoPE; every 4th layer is NoPE by default):
  RoPE layers attend within their chunk only (layer_types "chunked_attention": the query at position p sees the
  keys j <= p with j // attention_chunk_size == p // attention_chunk_size) and, with use_qk_norm, RMS-normalize
  q and k per head without a weight (before RoPE here, after it in transformers: a rotation keeps the norm);
  NoPE layers attend over the whole context without rotation and, with attn_temperature_tuning, scale the query
  at position p by 1 + attn_scale * log1p(floor((p + 1) / floor_scale));
- feed_forward: a dense SwiGLU MLP of intermediate_size_mlp, or in moe_layers (every interleave_moe_layer_step-th
  layer) MoE: router logits, top-k, sigmoid of those k (no renormalization), each weight scaling its expert's
  *input*; plus a shared expert of intermediate_size on every token, added unscaled. The experts are fused and
  transposed on disk: experts.gate_up_proj [E, H, 2I] (gate columns, then up), experts.down_proj [E, I, H];
- biases on q/k/v/o all or none (attention_bias); no router bias; nothing kept in float32.
Config: https://huggingface.co/docs/transformers/model_doc/llama4
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from cpumoe import ops, torch_gemm
from cpumoe.attention import (AttentionContext, DecodeBatch, causal_attention, decode_attention, paged_attention,
                              row_attention)
from cpumoe.layer import FusedMoE
from cpumoe.loader import Checkpoint, CheckpointConfig, CheckpointError
from cpumoe.loader.checkpoint import CheckpointView
from cpumoe.logs import logger
from cpumoe.models.architecture import Architecture, DecoderLayer, ModelPreset
from cpumoe.models.blocks import ExpertWeights, GatedMLP, MoEBlock, RMSNorm, RotaryEmbedding, apply_rotary
from cpumoe.models.rope import rope_from_config
from cpumoe.routing import select_experts

if TYPE_CHECKING:
    from cpumoe.presets import LayerPreset

LAYER_TYPES = ("chunked_attention", "full_attention")
MULTIMODAL = "llama4"  # Llama4ForConditionalGeneration's model_type
LANGUAGE_MODEL = "language_model."  # its language model's tensors
DEFAULT_ROPE_THETA = 500000.0  # Llama4TextConfig.default_theta


@dataclass(slots=True)
class Llama4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # each routed expert, and the shared expert
    intermediate_size_mlp: int  # dense layers
    num_local_experts: int
    num_experts_per_tok: int
    moe_layers: frozenset[int]
    rope_layers: list[bool]  # no_rope_layers as booleans: True where the layer rotates
    chunked_layers: list[bool]  # layer_types == "chunked_attention"
    attention_chunk_size: int | None
    use_qk_norm: bool
    attn_temperature_tuning: bool
    floor_scale: float
    attn_scale: float
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    attention_bias: bool
    tie_word_embeddings: bool

    def chunk(self, layer: int) -> int | None:
        """The attention chunk of layer `layer`, None where it attends over the whole context."""
        return self.attention_chunk_size if self.chunked_layers[layer] else None


def text_config(ckpt: CheckpointConfig) -> CheckpointConfig:
    """The text model's config: config.json itself (llama4_text) or its text_config (llama4)."""
    if ckpt.model_type != MULTIMODAL:
        return ckpt
    text = ckpt.config_get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{ckpt.path}: text_config must be an object, got {type(text).__name__}")
    return CheckpointConfig(ckpt.path, {"model_type": "llama4_text", **text})


def language_model(ckpt: Checkpoint) -> CheckpointView:
    """The language model of a multimodal llama4 checkpoint as a llama4_text one: config.json's text_config (with
    the top level's dtype), and the tensors under language_model. by their names without it (model.layers.0...,
    lm_head.weight). The vision tower and the projector are not in it."""
    if ckpt.config_get("quantization_config", default=None):
        raise CheckpointError(f"{ckpt.path}: quantized multimodal llama4 checkpoints (quantization_config) are "
                              "not supported; a llama4_text checkpoint of the language model is")
    text = text_config(ckpt).config
    dtype = {k: ckpt.config[k] for k in ("dtype", "torch_dtype") if k in ckpt.config and k not in text}
    names = {name.removeprefix(LANGUAGE_MODEL): name for name in ckpt.keys() if name.startswith(LANGUAGE_MODEL)}
    return CheckpointView(ckpt, {**text, **dtype}, names)


def parse_config(ckpt: CheckpointConfig) -> Llama4Config:
    multimodal = ckpt.model_type == MULTIMODAL
    ckpt = text_config(ckpt)
    get = ckpt.config_get
    where = f"{ckpt.path}: {'text_config.' if multimodal else ''}"
    act = get("hidden_act", default="silu")
    if act != "silu":
        raise CheckpointError(f"{where}hidden_act {act!r} is not supported (silu only)")
    layers = get("num_hidden_layers")
    heads = get("num_attention_heads")
    # transformers' defaults: MoE every interleave_moe_layer_step-th layer; NoPE every no_rope_layer_interval-th
    step = get("interleave_moe_layer_step", default=1)
    moe_layers = get("moe_layers", default=None)
    if moe_layers is None:
        if not isinstance(step, int) or step < 1:
            raise CheckpointError(f"{where}interleave_moe_layer_step must be a positive integer, got {step!r}")
        moe_layers = list(range(step - 1, layers, step))
    if not isinstance(moe_layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in moe_layers):
        raise CheckpointError(f"{where}moe_layers must be a list of layer indices, got {moe_layers!r}")
    no_rope = get("no_rope_layers", default=None)
    if not no_rope:
        interval = get("no_rope_layer_interval", default=4)
        if not isinstance(interval, int) or interval < 1:
            raise CheckpointError(f"{where}no_rope_layer_interval must be a positive integer, got {interval!r}")
        no_rope = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(no_rope, list) or len(no_rope) < layers or any(v not in (0, 1) for v in no_rope):
        raise CheckpointError(f"{where}no_rope_layers must give 1 (RoPE) or 0 (NoPE) for each of the {layers} "
                              f"layers, got {no_rope!r}")
    rope_layers = [bool(v) for v in no_rope[:layers]]
    chunk = get("attention_chunk_size", default=8192)
    layer_types = get("layer_types", default=None) or [
        "chunked_attention" if rope and chunk is not None else "full_attention" for rope in rope_layers]
    if len(layer_types) != layers or not set(layer_types) <= set(LAYER_TYPES):
        raise CheckpointError(f"{where}layer_types must give one of {LAYER_TYPES} per layer ({layers}), "
                              f"got {layer_types}")
    if "chunked_attention" in layer_types and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise CheckpointError(f"{where}layer_types has chunked_attention layers but attention_chunk_size is "
                              f"{chunk!r}")
    floor_scale = get("floor_scale", default=8192)
    if not isinstance(floor_scale, (int, float)) or floor_scale <= 0:
        raise CheckpointError(f"{where}floor_scale must be a positive number, got {floor_scale!r}")
    try:
        rope_theta, rope_scaling = rope_from_config({"rope_theta": DEFAULT_ROPE_THETA, **ckpt.config})
    except ValueError as e:
        raise CheckpointError(f"{where}{e}") from None
    top_k = get("num_experts_per_tok", default=1)
    experts = get("num_local_experts", default=16)
    if moe_layers and not 1 <= top_k <= experts:
        raise CheckpointError(f"{where}num_experts_per_tok={top_k} must be in [1, num_local_experts={experts}]")
    return Llama4Config(
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=get("num_key_value_heads", default=None) or heads,
        head_dim=get("head_dim", default=None) or get("hidden_size") // heads,
        intermediate_size=get("intermediate_size"), intermediate_size_mlp=get("intermediate_size_mlp", default=16384),
        num_local_experts=experts, num_experts_per_tok=top_k, moe_layers=frozenset(moe_layers),
        rope_layers=rope_layers, chunked_layers=[t == "chunked_attention" for t in layer_types],
        attention_chunk_size=chunk, use_qk_norm=bool(get("use_qk_norm", default=True)),
        # published configs say 4 here: transformers tests it for truth
        attn_temperature_tuning=bool(get("attn_temperature_tuning", default=True)),
        floor_scale=floor_scale, attn_scale=get("attn_scale", default=0.1),
        rms_norm_eps=get("rms_norm_eps", default=1e-5), rope_theta=rope_theta, rope_scaling=rope_scaling,
        attention_bias=bool(get("attention_bias", default=False)),
        tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
    )


def deinterleave_heads(x: torch.Tensor) -> torch.Tensor:
    """[..., d] with RoPE pairs at (2i, 2i + 1) -> [..., d] with them at (i, i + d/2): even channels, then odd."""
    d = x.shape[-1]
    return x.unflatten(-1, (d // 2, 2)).transpose(-1, -2).reshape(x.shape)


class Llama4Attention(nn.Module):
    """GQA of one Llama 4 layer: a RoPE layer (chunked, q/k norm) or a NoPE one (temperature-tuned queries); see
    the module docstring. Two ways in, as blocks.Attention: forward(x [B, T, H], positions [T]) without a cache,
    or forward(x [T, H], positions, context, layer) over the engine's paged cache."""

    def __init__(self, config: Llama4Config, layer: int):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=bias)
        self.use_rope = c.rope_layers[layer]
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling) if self.use_rope else None
        self.qk_norm_eps = c.rms_norm_eps if c.use_qk_norm and self.use_rope else None
        self.temperature = (c.floor_scale, c.attn_scale) if c.attn_temperature_tuning and not self.use_rope else None
        self.chunk = c.chunk(layer)
        self.batch_invariant = False
        self._ones: dict[torch.dtype, torch.Tensor] = {}  # the q/k norm's unit weight, per dtype

    def make_batch_invariant(self) -> None:
        self.batch_invariant = True

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., T, H] -> q [..., T, nh, d], k and v [..., T, nkv, d], as attention reads them: rotated (with
        rotary = float32 cos, sin [T, 1, d]) and normed, or temperature-tuned, as the layer says."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            cos, sin = rotary
            # in float32, then rounded, as transformers' complex product; the norm after it, in its order
            q = apply_rotary(deinterleave_heads(q).float(), cos, sin).to(q.dtype)
            k = apply_rotary(deinterleave_heads(k).float(), cos, sin).to(k.dtype)
        if self.qk_norm_eps is not None:
            q, k = self._l2_norm(q), self._l2_norm(k)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0  # [T]
            q = (q * scale[:, None, None]).to(q.dtype)
        return q, k, v

    def _rotary(self, positions: torch.Tensor, context: AttentionContext | None):
        """float32 cos, sin [T, 1, d] of the positions (None in a NoPE layer); once per step with a context: every
        RoPE layer has the same."""
        if not self.use_rope:
            return None
        return tuple(t[:, None] for t in self.rotary.for_step(positions, torch.float32, context))  # [T, 1, d]

    def _l2_norm(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head RMS norm without a weight (transformers' Llama4TextL2Norm): in float32, cast back."""
        if x.dtype not in self._ones:
            self._ones[x.dtype] = torch.ones(self.head_dim, dtype=x.dtype)
        return ops.rms_norm(x.contiguous(), self._ones[x.dtype], self.qk_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext | None = None,
                layer: int = 0) -> torch.Tensor:
        if context is not None:
            return self._forward_paged(x, positions, context, layer)
        B, T, _ = x.shape  # x [B, T, H], positions [T]
        q, k, v = self._qkv(x, positions, self._rotary(positions, None))  # [B, T, heads, d]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, d]
        step = self.chunk or T
        out = torch.cat([torch_gemm.scaled_dot_product_attention(q[:, :, s:s + step], k[:, :, s:s + step],
                                                                 v[:, :, s:s + step], is_causal=True, enable_gqa=True)
                         for s in range(0, T, step)], dim=2)  # [B, nh, T, d]: each chunk on its own
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))  # [B, T, H]

    def _forward_paged(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext,
                       layer: int) -> torch.Tensor:  # x [T, H], positions [T]
        T = x.shape[0]
        q, k, v = self._qkv(x, positions, self._rotary(positions, context))  # [T, nh, d], [T, nkv, d] x2
        k_cache, v_cache = context.kv_caches[layer]  # [num_blocks, block_size, nkv, d]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, context.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, context.slot_mapping, v.to(v_cache.dtype))
        if self.chunk is None:
            out = (row_attention if self.batch_invariant else paged_attention)(q, k_cache, v_cache, context)
        else:
            out = chunked_attention(q, k_cache, v_cache, context, self.chunk, batch_invariant=self.batch_invariant)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))  # [T, H]


def chunked_row_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: AttentionContext,
                          chunk: int) -> torch.Tensor:
    """Every token of the step as one row of the decode kernel over the keys of its chunk up to itself: batch-
    invariant, as attention.row_attention. q [T, nh, d] -> [T, nh, d]."""
    table, key_end = context.token_rows()  # key_end = position + 1
    key_begin = (key_end - 1) // chunk * chunk
    return ops.decode_attention(q.contiguous(), k_cache, v_cache, table, key_begin, key_end, q.shape[-1] ** -0.5)


def chunk_decode_batch(decode: DecodeBatch, chunk: int) -> DecodeBatch:
    """The decoding sequences over the keys of their query's chunk: the window of the last `chunk` keys holds them
    all (DecodeBatch.windowed), and its first (len - 1) % chunk keys belong to the previous chunk."""
    window = decode.windowed(chunk)
    seen = (window.lens - 1) % chunk + 1  # keys of the query's chunk, itself included
    # (its mask, valid, follows from the new key_begin when read)
    return replace(window, key_begin=window.key_end - seen, _valid=None, _windows={})


def chunked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: AttentionContext,
                      chunk: int, *, batch_invariant: bool = False) -> torch.Tensor:
    """Paged causal attention within chunks: the query at position p sees keys p - p % chunk .. p of its sequence.
    Decoding sequences go in one decode-kernel call; a prefill chunk of the engine splits where the attention
    chunks do, and each piece is causal attention over its attention chunk's keys so far (its queries are the
    last of them). q [T, nh, d]; caches [num_blocks, block_size, nkv, d] -> [T, nh, d]."""
    if batch_invariant:
        return chunked_row_attention(q, k_cache, v_cache, context, chunk)
    decode = context.decode_batch()
    if decode is not None:
        key = ("chunk-decode", chunk)
        if key not in context.cache:
            context.cache[key] = chunk_decode_batch(decode, chunk)
        decode = context.cache[key]
        if decode.token_index is None:
            return decode_attention(q, k_cache, v_cache, decode)
    out = torch.empty_like(q)
    if decode is not None:
        out[decode.token_index] = decode_attention(q[decode.token_index], k_cache, v_cache, decode)
    nkv, d, bs = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    start = 0
    for q_len, ctx_len, blocks in zip(context.query_lens, context.context_lens, context.block_tables):
        if q_len == 1:
            start += 1
            continue
        first = ctx_len - q_len  # position of the first query
        for c0 in range(first // chunk * chunk, ctx_len, chunk):  # each attention chunk the queries reach
            q0, q1 = max(first, c0), min(ctx_len, c0 + chunk)  # its queries' positions
            b0, b1 = c0 // bs, -(-q1 // bs)  # the cache blocks holding keys c0 .. q1 - 1
            k = k_cache[blocks[b0:b1]].view(-1, nkv, d)[c0 - b0 * bs:q1 - b0 * bs].transpose(0, 1)  # [nkv, L, d]
            v = v_cache[blocks[b0:b1]].view(-1, nkv, d)[c0 - b0 * bs:q1 - b0 * bs].transpose(0, 1)
            rows = slice(start + q0 - first, start + q1 - first)
            out[rows] = causal_attention(q[rows].transpose(0, 1), k, v).transpose(0, 1)  # [q1 - q0, nh, d]
        start += q_len
    return out


class Llama4MoE(MoEBlock):
    """Router `router` (no bias) -> top-k -> sigmoid weights that scale each chosen expert's input (FusedMoE's
    apply_router_weight_on_input), plus `shared_expert` on every token, added unscaled. The weights are rounded to
    the activations' dtype before they scale the input, as transformers rounds its scores. The kernel scales the
    input of one expert per token and call: top-k > 1 runs one call per slot (the published models are top-1)."""

    def __init__(self, *, hidden_size: int, num_experts: int, inter_size: int, top_k: int, backend: str = "auto"):
        super().__init__(hidden_size=hidden_size, num_experts=num_experts, inter_size=inter_size, top_k=top_k,
                         renormalize=False, backend=backend)
        del self.gate  # the router is named `router` here
        self.router = nn.Linear(hidden_size, num_experts, bias=False)  # [E, H]
        self.shared_expert = GatedMLP(hidden_size, inter_size)

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor, expert_reader=None, dtype=None) -> None:
        self.experts = FusedMoE(w13, w2, top_k=1, scoring="sigmoid", renormalize=False,
                                apply_router_weight_on_input=True, backend=self.backend, expert_reader=expert_reader,
                                dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H]
        if self.experts is None:
            raise RuntimeError("Llama4MoE has no experts yet: load the model with cpumoe.models.load_model")
        flat = x.reshape(-1, x.shape[-1])  # [M, H]
        weights, ids = select_experts(self.router(flat), self.top_k, scoring="sigmoid")  # [M, k] float32, int32
        weights = weights.to(flat.dtype).float()
        out = self.shared_expert(flat)  # [M, H]
        for slot in range(self.top_k):
            out = out + self.experts.experts(flat, weights[:, slot:slot + 1].contiguous(),
                                             ids[:, slot:slot + 1].contiguous())
        return out.view(x.shape)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, scoring=sigmoid, router_weight_on_input=True"


class Llama4TextArchitecture(Architecture):
    model_type = "llama4_text"
    also_reads = (MULTIMODAL,)
    hf_name = "Llama4"
    hf_config_class, hf_model_class = "Llama4TextConfig", "Llama4ForCausalLM"
    presets = (
        ModelPreset("llama-4-scout-17b-16e", "meta-llama/Llama-4-Scout-17B-16E", dict(
            num_hidden_layers=48, hidden_size=5120, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
            vocab_size=202048, intermediate_size=8192, intermediate_size_mlp=16384, num_local_experts=16,
            num_experts_per_tok=1, interleave_moe_layer_step=1, no_rope_layer_interval=4, use_qk_norm=True,
            attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
            attention_bias=False, hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=262144,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
            tie_word_embeddings=False)),
        ModelPreset("llama-4-maverick-17b-128e", "meta-llama/Llama-4-Maverick-17B-128E", dict(
            num_hidden_layers=48, hidden_size=5120, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
            vocab_size=202048, intermediate_size=8192, intermediate_size_mlp=16384, num_local_experts=128,
            num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=4, use_qk_norm=False,
            attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
            attention_bias=False, hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=1048576,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False)),
    )
    # 3 layers: RoPE + chunked (dense), NoPE + temperature-tuned + full (MoE), RoPE + chunked (dense); chunks of 4
    # tokens (the conformance prompt has 11); floor_scale 2 so the temperature changes within the prompt
    tiny = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                intermediate_size=32, intermediate_size_mlp=48, num_local_experts=8, num_experts_per_tok=1,
                interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=4, floor_scale=2,
                attn_scale=0.5, use_qk_norm=True, attention_bias=True,
                rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16})

    def config(self, ckpt: CheckpointConfig) -> Llama4Config:
        return parse_config(ckpt)

    def open_checkpoint(self, ckpt: Checkpoint) -> Checkpoint:
        if ckpt.model_type != MULTIMODAL:
            return ckpt
        skipped = sum(not name.startswith(LANGUAGE_MODEL) for name in ckpt.keys())
        logger.info("%s: llama4 multimodal checkpoint: loading its language model (text only); the vision tower "
                    "and projector (%d tensors) are skipped", ckpt.path, skipped)
        return language_model(ckpt)

    def layer(self, config: Llama4Config, index: int, backend: str) -> nn.Module:
        c = config
        if index in c.moe_layers:
            mlp: nn.Module = Llama4MoE(hidden_size=c.hidden_size, num_experts=c.num_local_experts,
                                       inter_size=c.intermediate_size, top_k=c.num_experts_per_tok, backend=backend)
        else:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size_mlp)
        return DecoderLayer(index, self_attn=Llama4Attention(c, index), mlp=mlp, mlp_name="feed_forward",
                            input_layernorm=RMSNorm(c.hidden_size, c.rms_norm_eps),
                            post_attention_layernorm=RMSNorm(c.hidden_size, c.rms_norm_eps))

    def expert_weights(self, config: Llama4Config) -> dict[str, ExpertWeights]:
        """Per-expert names, for checkpoints that store the experts so; the fused tensors of the published ones
        and of save_pretrained (transposed) are experts_from_checkpoint's."""
        return {"w13": ExpertWeights(per_expert=("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight")),
                "w2": ExpertWeights(per_expert=("experts.{e}.down_proj.weight",))}

    def expert_tensors(self, config: Llama4Config, block: MoEBlock) -> list[tuple[str, tuple[int, ...]]]:
        """The fused layout of the published checkpoints and save_pretrained."""
        E, I, H = block.num_experts, block.inter_size, block.hidden_size
        return [("experts.gate_up_proj", (E, H, 2 * I)), ("experts.down_proj", (E, I, H))]

    def experts_from_checkpoint(self, config: Llama4Config, ckpt: Checkpoint, prefix: str, block: MoEBlock,
                                dtype: torch.dtype) -> dict | None:
        """experts.gate_up_proj [E, H, 2I] and experts.down_proj [E, I, H], read and transposed one expert at a time
        into w13 [2I, H] (gate rows, then up rows) and w2 [H, I]; None where the checkpoint has them per expert."""
        name = f"{prefix}.experts"
        if f"{name}.gate_up_proj" not in ckpt:
            return None
        E, I, H = block.num_experts, block.inter_size, block.hidden_size
        for tensor, shape in ((f"{name}.gate_up_proj", (E, H, 2 * I)), (f"{name}.down_proj", (E, I, H))):
            if tensor not in ckpt:
                raise CheckpointError(f"tensor {tensor!r} not found in checkpoint {ckpt.path}")
            if tuple(ckpt.shape(tensor)) != shape:
                raise CheckpointError(f"tensor {tensor!r} in {ckpt.path} has shape {list(ckpt.shape(tensor))}, "
                                      f"expected {list(shape)}")
            if ckpt.dtype(tensor) not in (torch.float32, torch.bfloat16, torch.float16):
                raise CheckpointError(f"tensor {tensor!r} in {ckpt.path} is {ckpt.dtype(tensor)}: quantized fused "
                                      "experts are not supported (float32, bfloat16 or float16 only)")

        def read_expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            gate_up = ckpt.read(f"{name}.gate_up_proj", index=e).to(dtype)  # [H, 2I]
            down = ckpt.read(f"{name}.down_proj", index=e).to(dtype)  # [I, H]
            return gate_up.T.contiguous(), down.T.contiguous()  # [2I, H], [H, I]

        return dict(w13=torch.empty(E, 2 * I, H, dtype=dtype, device="meta"),
                    w2=torch.empty(E, H, I, dtype=dtype, device="meta"), expert_reader=read_expert)

    def layer_shape_config(self, *, hidden: int, inter: int, experts: int, top_k: int) -> dict:
        return dict(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k)

    def layer_preset(self, preset: ModelPreset) -> LayerPreset:
        from cpumoe.presets import LayerPreset
        c = self.preset_config(preset)
        return LayerPreset(preset.name, hidden=c.hidden_size, inter=c.intermediate_size, experts=c.num_local_experts,
                           top_k=c.num_experts_per_tok, shared_experts=1, activation="silu", scoring="sigmoid",
                           renormalize=False, shared_inter=c.intermediate_size, router_weight_on_input=True)


ARCHITECTURE = Llama4TextArchitecture()
