"""Blocks shared by the decoder-only models: RMSNorm, rotary embedding, causal GQA attention, gated MLP, MoE.
The attention maths over the paged cache lives in cpumoe.attention; the Attention module here projects, normalizes,
rotates and calls it.

Numerics follow transformers' Llama/Qwen family, so logits match it in bf16 as well as fp32: norms compute in
fp32 and cast back before the weight; cos/sin are built in fp32 and cast to the activations' dtype.
Shapes: B batch, T tokens, H hidden, nh / nkv query / key-value heads, d head_dim, E experts, I inter size.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from cpumoe import ops, torch_gemm
from cpumoe.attention import AttentionContext, causal_attention, paged_attention, row_attention
from cpumoe.layer import FusedMoE
from cpumoe.models.packed_linear import join_linears
from cpumoe.models.rope import rope_parameters


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float: bool = False) -> torch.Tensor:
    """transformers' RMSNorm: the row normalized in float32, cast to x's dtype before the weight multiplies it
    (Llama, Qwen), or the weight multiplied in float32 before the cast (weight_in_float: gpt-oss)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_float:
        return (weight.float() * xf).to(x.dtype)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    weight_in_float = False  # see rms_norm_reference

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if not self._runs_op(x):
            # dtype promotion is part of the maths here (a float32 weight makes a float32 output): torch's
            return rms_norm_reference(x, self.weight, self.eps, self.weight_in_float)
        return ops.rms_norm(x.contiguous(), self.weight, self.eps, weight_in_float=self.weight_in_float)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual): the residual add before a pre-norm, in one pass (ops.add_rms_norm)
        where the op runs this norm; the same values as the add and the norm apart."""
        if not self._runs_op(x) or residual.dtype != x.dtype or residual.shape != x.shape:
            total = x + residual
            return self(total), total
        return ops.add_rms_norm(x.contiguous(), residual.contiguous(), self.weight, self.eps,
                                weight_in_float=self.weight_in_float)

    def _runs_op(self, x: torch.Tensor) -> bool:
        return x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.bfloat16, torch.float16)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """RoPE, rotate-half layout: cos, sin [T, d] of positions * inv_freq, times the attention factor (as transformers:
    `cos = emb.cos() * attention_scaling`). inv_freq and the factor come from rope.py: scaling None is default RoPE
    (inv_freq[i] = theta^(-2i/d), factor 1), else a rope dict (linear, yarn, llama3; see rope.rope_from_config).
    inv_freq is a plain float32 CPU tensor, not a buffer: models are built on the meta device, and it stays fp32."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None, *,
                 frequencies: tuple[torch.Tensor, float] | None = None):
        """frequencies: (inv_freq [d/2], attention factor) an architecture computes itself (Phi-3.5-MoE's longrope,
        Gemma 4's proportional RoPE), in place of rope.py's for `scaling`, which then only names them."""
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.inv_freq, self.attention_factor = frequencies or rope_parameters(head_dim, theta, scaling)  # [d/2], float
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # cos, sin [positions, d]

    @property
    def cache_key(self) -> tuple:
        """Equal for rotaries that give the same cos/sin (layers share one step's)."""
        return ("rope", self.head_dim, self.theta, repr(sorted((self.scaling or {}).items())))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Rows of a table of every position so far, as vLLM's cos_sin_cache: computing cos and sin of a decode
        # step's one position took 0.2 ms a step (2% of an int4 one), the lookup a few microseconds. The table holds
        # the same values, so this changes no bit. Traced (fake) positions have no values to size it by.
        if isinstance(positions, FakeTensor) or torch.compiler.is_compiling():
            return tuple(t.to(dtype) for t in self._cos_sin(positions.float()))
        cos, sin = self.tables(dtype, int(positions.max()) + 1 if positions.numel() else 0)
        return cos[positions], sin[positions]

    def tables(self, dtype: torch.dtype, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, d] in dtype of every position below P >= length: forward's rows (the fused decode step takes
        its rows from these itself)."""
        cos, sin = self._tables.get(dtype, (None, None))
        if cos is None or cos.shape[0] < length:
            rows = max(256, 1 << max(length - 1, 1).bit_length())  # grown by doubling: at most 2x the longest context
            cos, sin = self._tables[dtype] = tuple(t.to(dtype) for t in self._cos_sin(torch.arange(rows).float()))
        return cos, sin

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype,
                 context: AttentionContext | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, d] (contiguous) of a step's positions: once per step in context.cache, shared by every layer
        whose rotary gives the same values (every layer sees the same positions); without a context, computed."""
        if context is None:
            return self(positions, dtype)
        key = (*self.cache_key, dtype)
        if key not in context.cache:
            context.cache[key] = tuple(t.contiguous() for t in self(positions, dtype))
        return context.cache[key]

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos, sin [T, d] of float positions [T]."""
        freqs = positions[:, None] * self.inv_freq[None, :]  # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def extra_repr(self) -> str:
        scaling = f", scaling={self.scaling}" if self.scaling else ""
        return f"head_dim={self.head_dim}, theta={self.theta}{scaling}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d] with cos, sin [T, d]; or x [T, heads, d] with cos, sin [T, 1, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class QKNorm(Enum):
    """Where an attention block RMS-normalizes its queries and keys (before RoPE)."""
    NONE = "none"
    HEAD = "head"  # per head, weight [d] (Qwen3-MoE)
    FULL = "full"  # over the whole projection before the split into heads, weights [nh * d], [nkv * d] (OLMoE)


class Attention(nn.Module):
    """Causal grouped-query attention with optional q/k RMSNorm (QKNorm), q/k/v and o biases, q/k/v clipping
    (|x| <= clip_qkv after the norm, OLMoE), attention sinks (`sinks` [nh], a learned per-head logit in the softmax
    denominator, gpt-oss) and a sliding window (each query sees its last `sliding_window` keys). Two ways in:
    - forward(x [B, T, H], positions [T]): the whole sequence at once, no cache (reference / tests);
    - forward(x [T, H], positions, context=AttentionContext, layer=l): flat tokens of several sequences; the new
      K/V go into layer l's paged cache, and each sequence attends over its cached context."""

    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rope_theta: float,
                 qk_norm: QKNorm, norm_eps: float, qkv_bias: bool = False, o_bias: bool = False,
                 clip_qkv: float | None = None, rope_scaling: dict | None = None, sinks: bool = False,
                 sliding_window: int | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.qk_norm, self.clip_qkv = QKNorm(qk_norm), clip_qkv
        q_dim, k_dim = (num_heads * head_dim, num_kv_heads * head_dim) if qk_norm == QKNorm.FULL else (head_dim, head_dim)
        self.q_norm = None if qk_norm == QKNorm.NONE else RMSNorm(q_dim, norm_eps)
        self.k_norm = None if qk_norm == QKNorm.NONE else RMSNorm(k_dim, norm_eps)
        self.rotary = RotaryEmbedding(head_dim, rope_theta, rope_scaling)
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None  # [nh]
        self.sliding_window = sliding_window
        self.batch_invariant = False  # paged forward: row_attention instead of paged_attention
        self.qkv_proj: nn.Module | None = None  # q, k and v in one GEMM, once packed (join_projections)
        self._head_norms_fusable: bool | None = None  # see _fused_head_norms

    def make_batch_invariant(self) -> None:
        self.batch_invariant = True

    def join_projections(self) -> str | None:
        """Run q_proj, k_proj and v_proj as one packed GEMM, qkv_proj (packed_linear.join_linears), in place of
        the three; None when done, else why their packing cannot join (they stay three)."""
        try:
            self.qkv_proj = join_linears([self.q_proj, self.k_proj, self.v_proj])
        except ValueError as e:
            return str(e)
        self.q_proj = self.k_proj = self.v_proj = None
        return None

    def _qkv(self, x: torch.Tensor, head_norm: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., H] -> q [..., nh, d], k and v [..., nkv, d], normed and clipped, before RoPE (head_norm False:
        without the per-head q/k norm, which the caller fuses)."""
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [..., nh * d], [..., nkv * d] x2
        else:
            kv = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split_with_sizes((self.num_heads * self.head_dim, kv, kv), dim=-1)
        if self.qk_norm == QKNorm.FULL:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        lead = x.shape[:-1]
        q = q.view(*lead, self.num_heads, self.head_dim)  # [..., nh, d]
        k = k.view(*lead, self.num_kv_heads, self.head_dim)  # [..., nkv, d]
        v = v.view(*lead, self.num_kv_heads, self.head_dim)  # [..., nkv, d]
        if self.qk_norm == QKNorm.HEAD and head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _fused_head_norms(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The q/k norm weights rope_and_cache applies itself (per-head norms in the Llama order, weights in the
        activations' dtype); None where the norm modules run (no per-head norm, or another rounding). The
        structural checks are made once (~30 us a layer at every step otherwise)."""
        if self._head_norms_fusable is None:
            self._head_norms_fusable = (self.qk_norm == QKNorm.HEAD and not self.q_norm.weight_in_float
                                        and not self.k_norm.weight_in_float and self.q_norm.eps == self.k_norm.eps)
        if not self._head_norms_fusable or dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        q_weight, k_weight = self.q_norm.weight, self.k_norm.weight
        return (q_weight, k_weight) if q_weight.dtype == dtype and k_weight.dtype == dtype else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext | None = None,
                layer: int = 0) -> torch.Tensor:
        if context is not None:
            return self._forward_paged(x, positions, context, layer)
        B, T, _ = x.shape  # x [B, T, H], positions [T]
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x))  # [B, heads, T, d]
        cos, sin = self.rotary(positions, x.dtype)  # [T, d]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.sinks is None and self.sliding_window is None:
            out = torch_gemm.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, nh, T, d]
        else:
            out = torch.stack([causal_attention(q[b], k[b], v[b], sliding_window=self.sliding_window, sinks=self.sinks)
                               for b in range(B)])  # [B, nh, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))  # [B, T, H]

    def _forward_paged(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext,
                       layer: int) -> torch.Tensor:  # x [T, H], positions [T]
        T = x.shape[0]
        norms = self._fused_head_norms(x.dtype)
        q, k, v = self._qkv(x, head_norm=norms is None)  # [T, nh, d], [T, nkv, d], [T, nkv, d]
        cos, sin = self.rotary.for_step(positions, x.dtype, context)  # [T, d]
        k_cache, v_cache = context.kv_caches[layer]  # [num_blocks, block_size, nkv, d]
        # (q/k norm,) RoPE on q and k in place, then k and v into their slots: one op (two RMSNorms, apply_rotary
        # and two index_puts)
        q, k, v = q.contiguous(), k.contiguous(), v.to(v_cache.dtype).contiguous()
        ops.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, context.slot_mapping,
                           *(norms or (None, None)), self.q_norm.eps if norms else 1e-6)
        attention = row_attention if self.batch_invariant else paged_attention
        out = attention(q, k_cache, v_cache, context, sinks=self.sinks, sliding_window=self.sliding_window)  # [T, nh, d]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))  # [T, H]


class GatedMLP(nn.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, inter_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, inter_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, inter_size, bias=False)
        self.down_proj = nn.Linear(inter_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """Where one fused experts tensor (w13 or w2) comes from, in names relative to the MoE block.

    per_expert: tensors for expert "{e}", concatenated on dim 0 and stacked over experts (published checkpoints:
        ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight") -> w13 [E, 2I, H]).
    fused: the same data already stacked [E, ...] under one name (transformers' in-memory layout), if present.
    """
    per_expert: tuple[str, ...]
    fused: str | None = None


class MoEBlock(nn.Module):
    """Router linear -> cpumoe.FusedMoE (softmax, top-k, renormalized if `renormalize`), plus, if
    shared_inter_size > 0, a dense shared expert on every token, gated by sigmoid(shared_expert_gate(x)) (Qwen2-MoE).
    The routed experts arrive after construction, through `load_experts`, because FusedMoE packs its weights once
    for the kernel it picks; the shared expert is ordinary parameters."""

    def __init__(self, *, hidden_size: int, num_experts: int, inter_size: int, top_k: int, renormalize: bool,
                 shared_inter_size: int = 0, backend: str = "auto"):
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # router: weight [E, H]
        self.shared_expert = GatedMLP(hidden_size, shared_inter_size) if shared_inter_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_inter_size else None  # [1, H]
        self.num_experts, self.inter_size, self.hidden_size = num_experts, inter_size, hidden_size
        self.top_k, self.renormalize, self.backend = top_k, renormalize, backend
        self.experts: FusedMoE | None = None

    @property
    def expert_shapes(self) -> dict[str, tuple[int, ...]]:
        E, I, H = self.num_experts, self.inter_size, self.hidden_size
        return {"w13": (E, 2 * I, H), "w2": (E, H, I)}

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor, expert_reader=None, dtype=None) -> None:
        """w13 [E, 2I, H], w2 [E, H, I] (float tensors or cpumoe.quant.QuantizedWeight stacks); or meta ones of
        those shapes and an expert_reader (see FusedMoE). dtype: the activations' dtype of quantized experts."""
        self.experts = FusedMoE(w13, w2, top_k=self.top_k, renormalize=self.renormalize, backend=self.backend,
                                expert_reader=expert_reader, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H]
        if self.experts is None:
            raise RuntimeError("MoEBlock has no experts yet: load the model with cpumoe.models.load_model")
        flat = x.reshape(-1, x.shape[-1])  # [M, H]
        router_logits = self.gate(flat)  # [M, E]
        out = self.experts(flat, router_logits)  # [M, H]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)  # [M, 1] * [M, H]
        return out.view(x.shape)  # [..., H]

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, renormalize={self.renormalize}"
