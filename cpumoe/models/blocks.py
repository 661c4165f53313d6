"""Blocks shared by the decoder-only models: RMSNorm, rotary embedding, causal GQA attention, gated MLP, MoE.

Numerics follow transformers' Llama/Qwen family, so logits match it in bf16 as well as fp32: norms compute in
fp32 and cast back before the weight; cos/sin are built in fp32 and cast to the activations' dtype.
Shapes: B batch, T tokens, H hidden, nh / nkv query / key-value heads, d head_dim, E experts, I inter size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

from cpumoe import ops
from cpumoe.layer import FusedMoE
from cpumoe.models.prefill_attention import causal_attention
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
        if x.dtype != self.weight.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            # dtype promotion is part of the maths here (a float32 weight makes a float32 output): torch's
            return rms_norm_reference(x, self.weight, self.eps, self.weight_in_float)
        return ops.rms_norm(x.contiguous(), self.weight, self.eps, weight_in_float=self.weight_in_float)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """RoPE, rotate-half layout: cos, sin [T, d] of positions * inv_freq, times the attention factor (as transformers:
    `cos = emb.cos() * attention_scaling`). inv_freq and the factor come from rope.py: scaling None is default RoPE
    (inv_freq[i] = theta^(-2i/d), factor 1), else a rope dict (linear, yarn, llama3; see rope.rope_from_config).
    inv_freq is a plain float32 CPU tensor, not a buffer: models are built on the meta device, and it stays fp32."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.inv_freq, self.attention_factor = rope_parameters(head_dim, theta, scaling)  # [d/2], float

    @property
    def cache_key(self) -> tuple:
        """Equal for rotaries that give the same cos/sin (layers share one step's)."""
        return ("rope", self.head_dim, self.theta, repr(sorted((self.scaling or {}).items())))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        scaling = f", scaling={self.scaling}" if self.scaling else ""
        return f"head_dim={self.head_dim}, theta={self.theta}{scaling}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d] with cos, sin [T, d]; or x [T, heads, d] with cos, sin [T, 1, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@dataclass(slots=True)
class AttentionContext:
    """Where one engine step's flat tokens belong: S sequences, T = sum(query_lens) tokens, sequence i's tokens
    contiguous and in order. Sequence i has context_lens[i] tokens in all (cached + new); its query_lens[i] new
    tokens are the last ones (a prefill chunk, or 1 for a decode) and attend causally to all of them.

    positions [T] long            position of each new token in its sequence (RoPE)
    slot_mapping [T] long         where each new token's K/V goes: block * block_size + offset
    block_tables list of [n_i] long  sequence i's cache blocks, in order (n_i * block_size >= context_lens[i])
    kv_caches                     per layer (k, v): [num_blocks, block_size, nkv, k_dim] and [..., nkv, v_dim] in
                                  the model dtype, as the model's KVCacheLayout says (GQA: k_dim = v_dim = d;
                                  MLA's latent cache: one "head" of kv_lora_rank + rope dims and an empty V)
    cache                         per-step values every layer shares (rotary cos/sin, the decode block table),
                                  built by the first layer that needs them
    """
    positions: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor
    block_tables: list[torch.Tensor]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    cache: dict = field(default_factory=dict)

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of the step as a row of its own: block_table [T, n] (its sequence's table, padded with block
        0) and key_end [T] = position + 1 (a token sees the keys up to itself). Built once per step."""
        if "rows" not in self.cache:
            n = max(t.numel() for t in self.block_tables)
            tables = torch.zeros(len(self.block_tables), n, dtype=torch.long)  # [S, n]
            for i, t in enumerate(self.block_tables):
                tables[i, :t.numel()] = t
            rows = tables.repeat_interleave(torch.tensor(self.query_lens), dim=0)  # [T, n]
            self.cache["rows"] = rows, self.positions + 1
        return self.cache["rows"]

    def decode_batch(self) -> "DecodeBatch | None":
        """The sequences that decode (query_lens 1) this step, as padded tensors; None when there are none."""
        if "decode" not in self.cache:
            rows = [i for i, q in enumerate(self.query_lens) if q == 1]
            self.cache["decode"] = DecodeBatch.build(self, rows) if rows else None
        return self.cache["decode"]


@dataclass(slots=True)
class DecodeBatch:
    """The decoding sequences of a step, batched for one attention call per layer.

    token_index [S] long or None   their tokens' rows in the step's flat tokens (None: every row, in order)
    block_table [S, n] long        block tables padded (with block 0) to the longest
    valid [S, 1, 1, n * block_size] bool   key positions inside each sequence's context
    lens [S] long                  context lengths (the query is the last token)
    key_begin, key_end [S] long    the same keys as a range of positions over each table (what the kernel takes)
    """
    token_index: torch.Tensor | None
    block_table: torch.Tensor
    valid: torch.Tensor
    seq_rows: list[int]
    lens: torch.Tensor
    block_size: int
    key_begin: torch.Tensor
    key_end: torch.Tensor
    _windows: dict = field(default_factory=dict)  # sliding window -> its DecodeBatch (see windowed)

    @classmethod
    def build(cls, context: AttentionContext, rows: list[int]) -> "DecodeBatch":
        starts = [0]
        for q in context.query_lens:
            starts.append(starts[-1] + q)
        n = max(context.block_tables[i].numel() for i in rows)
        table = torch.zeros(len(rows), n, dtype=torch.long)  # [S, n]
        for r, i in enumerate(rows):
            table[r, :context.block_tables[i].numel()] = context.block_tables[i]
        block_size = context.kv_caches[0][0].shape[1] if context.kv_caches else 1
        lens = torch.tensor([context.context_lens[i] for i in rows], dtype=torch.long)  # [S]
        valid = torch.arange(n * block_size)[None, :] < lens[:, None]  # [S, L]
        all_rows = len(rows) == len(context.query_lens)
        index = None if all_rows else torch.tensor([starts[i] for i in rows], dtype=torch.long)
        return cls(token_index=index, block_table=table, valid=valid[:, None, None, :], seq_rows=rows, lens=lens,
                   block_size=block_size, key_begin=torch.zeros_like(lens), key_end=lens)

    def windowed(self, window: int) -> "DecodeBatch":
        """The same sequences over their last `window` keys only (sliding-window layers: the query at position
        len - 1 sees keys len - window .. len - 1): block tables start at the block holding key len - window, so a
        layer reads O(window) keys, not the whole context. Built once per step and window."""
        if window not in self._windows:
            bs = self.block_size
            first = (self.lens - window).clamp(min=0) // bs  # [S] first block needed
            n = int((-(-self.lens // bs) - first).max())  # blocks in the longest window
            cols = (first[:, None] + torch.arange(n)[None, :]).clamp(max=self.block_table.shape[1] - 1)  # [S, n]
            key_pos = first[:, None] * bs + torch.arange(n * bs)[None, :]  # [S, n * bs]
            valid = (key_pos < self.lens[:, None]) & (key_pos >= self.lens[:, None] - window)
            table = self.block_table.gather(1, cols)  # [S, n]
            key_end = self.lens - first * bs  # positions over the windowed table
            self._windows[window] = DecodeBatch(token_index=self.token_index, block_table=table,
                                                valid=valid[:, None, None, :], seq_rows=self.seq_rows, lens=self.lens,
                                                block_size=bs, key_begin=(key_end - window).clamp(min=0),
                                                key_end=key_end)
        return self._windows[window]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
                     scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence over its paged context, all sequences at once (GQA without repeating K/V):
    the C++ kernel (ops.decode_attention: each K/V row read once from the cache, online softmax in float32).
    q [S, nh, d]; caches [num_blocks, block_size, nkv, d] -> [S, nh, d]; sinks as decode_attention_reference."""
    return ops.decode_attention(q.contiguous(), k_cache, v_cache, batch.block_table, batch.key_begin, batch.key_end,
                                q.shape[-1] ** -0.5 if scale is None else scale,
                                None if sinks is None else sinks.float().contiguous())


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
                               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention's maths in torch, the reference its kernel is tested against. Scores, softmax and the
    weighted sum in float32. sinks [nh]: attention sinks, a per-head logit in the softmax denominator that adds
    no value (gpt-oss)."""
    S, nh, d = q.shape
    nkv, dv = k_cache.shape[2], v_cache.shape[3]
    g, L = nh // nkv, batch.block_table.shape[1] * k_cache.shape[1]
    # gather, head-major layout and float32 in one copy each, so both GEMMs run on [S * nkv] contiguous batches
    # (matmul over the transposed views copied them again: 3x slower at 16 x 576 tokens)
    k = torch.empty(S, nkv, L, d).copy_(k_cache[batch.block_table].view(S, L, nkv, d).permute(0, 2, 1, 3))
    v = torch.empty(S, nkv, L, dv).copy_(v_cache[batch.block_table].view(S, L, nkv, dv).permute(0, 2, 1, 3))
    qg = q.float().view(S * nkv, g, d) * (d ** -0.5 if scale is None else scale)  # [S * nkv, g, d]
    scores = torch.bmm(qg, k.view(S * nkv, L, d).transpose(1, 2)).view(S, nkv, g, L)  # [S, nkv, g, L]
    scores.masked_fill_(~batch.valid, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.float().view(1, nkv, g, 1).expand(S, -1, -1, -1)  # [S, nkv, g, 1]
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]  # the sink's share dropped
    out = torch.bmm(probs.reshape(S * nkv, g, L), v.view(S * nkv, L, dv))  # [S * nkv, g, dv]
    return out.view(S, nh, dv).to(q.dtype)


def row_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: AttentionContext, *,
                  scale: float | None = None, sinks: torch.Tensor | None = None,
                  sliding_window: int | None = None) -> torch.Tensor:
    """Batch-invariant paged attention: every token of the step, prefill or decode, is one row of the decode kernel
    over the keys [position - window + 1, position] of its sequence's table, so its result depends on its query and
    the cache alone, never on which tokens share its step or its chunk (the kernel sums each row over key tiles
    from its first key, in one fixed order). Costs 1.2-1.7x paged_attention's prefill GEMMs on long prompts.
    q [T, nh, d]; caches [num_blocks, block_size, nkv, d | dv] (or a view of each slot's leading channels)
    -> [T, nh, dv]."""
    table, key_end = context.token_rows()
    key_begin = torch.zeros_like(key_end) if sliding_window is None else (key_end - sliding_window).clamp(min=0)
    return ops.decode_attention(q.contiguous(), k_cache, v_cache, table, key_begin, key_end,
                                q.shape[-1] ** -0.5 if scale is None else scale,
                                None if sinks is None else sinks.float().contiguous())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: AttentionContext, *,
                    sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """Paged attention: all decoding sequences in one batched call (decode_attention); each prefill chunk gathers
    its cached K/V blocks and runs prefill_attention.causal_attention (blocked causal GEMMs, GQA without repeating
    K/V; 2x SDPA's fused CPU kernel at 512 tokens).
    q [T, nh, d]; k_cache, v_cache [num_blocks, block_size, nkv, d] -> [T, nh, d].
    With sinks [nh] (a per-head logit in the softmax denominator that adds no value, gpt-oss) or a sliding window
    (query at position p sees keys p - window < j <= p), decodes add the sink logit beside their scores and read only
    the window's blocks (DecodeBatch.windowed), and prefill chunks read only the keys some query sees."""
    decode = context.decode_batch()
    if decode is not None and sliding_window is not None:
        decode = decode.windowed(sliding_window)
    if decode is not None and decode.token_index is None:
        return decode_attention(q, k_cache, v_cache, decode, sinks=sinks)
    out = torch.empty_like(q)
    if decode is not None:
        out[decode.token_index] = decode_attention(q[decode.token_index], k_cache, v_cache, decode, sinks=sinks)
    nh, nkv, d, dv = q.shape[1], k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
    start = 0
    for q_len, ctx_len, blocks in zip(context.query_lens, context.context_lens, context.block_tables):
        if q_len == 1:
            start += 1
            continue
        # keys before k0 are outside every query's window (k0 = 0 without one)
        k0 = 0 if sliding_window is None else max(0, ctx_len - q_len - sliding_window + 1)
        k = k_cache[blocks].view(-1, nkv, d)[k0:ctx_len].transpose(0, 1)  # [nkv, ctx - k0, d]
        v = v_cache[blocks].view(-1, nkv, dv)[k0:ctx_len].transpose(0, 1)  # [nkv, ctx - k0, dv]
        # the queries are the last q_len of the keys kept (bottom-right causal)
        o = causal_attention(q[start:start + q_len].transpose(0, 1), k, v, sliding_window=sliding_window,
                             sinks=sinks)  # [nh, q_len, dv]
        out[start:start + q_len] = o.transpose(0, 1)  # [q_len, nh, dv]
        start += q_len
    return out


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

    def make_batch_invariant(self) -> None:
        self.batch_invariant = True

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., H] -> q [..., nh, d], k and v [..., nkv, d], normed and clipped, before RoPE."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [..., nh * d], [..., nkv * d] x2
        if self.qk_norm == QKNorm.FULL:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        lead = x.shape[:-1]
        q = q.view(*lead, self.num_heads, self.head_dim)  # [..., nh, d]
        k = k.view(*lead, self.num_kv_heads, self.head_dim)  # [..., nkv, d]
        v = v.view(*lead, self.num_kv_heads, self.head_dim)  # [..., nkv, d]
        if self.qk_norm == QKNorm.HEAD:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext | None = None,
                layer: int = 0) -> torch.Tensor:
        if context is not None:
            return self._forward_paged(x, positions, context, layer)
        B, T, _ = x.shape  # x [B, T, H], positions [T]
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x))  # [B, heads, T, d]
        cos, sin = self.rotary(positions, x.dtype)  # [T, d]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.sinks is None and self.sliding_window is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, nh, T, d]
        else:
            out = torch.stack([causal_attention(q[b], k[b], v[b], sliding_window=self.sliding_window, sinks=self.sinks)
                               for b in range(B)])  # [B, nh, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))  # [B, T, H]

    def _forward_paged(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext,
                       layer: int) -> torch.Tensor:  # x [T, H], positions [T]
        T = x.shape[0]
        q, k, v = self._qkv(x)  # [T, nh, d], [T, nkv, d], [T, nkv, d]
        key = (*self.rotary.cache_key, x.dtype)
        if key not in context.cache:  # once per step: every layer has the same positions
            cos, sin = self.rotary(positions, x.dtype)  # [T, d]
            context.cache[key] = cos.contiguous(), sin.contiguous()
        cos, sin = context.cache[key]
        k_cache, v_cache = context.kv_caches[layer]  # [num_blocks, block_size, nkv, d]
        # RoPE on q and k in place, then k and v into their slots: one op (apply_rotary and two index_puts)
        q, k, v = q.contiguous(), k.contiguous(), v.to(v_cache.dtype).contiguous()
        ops.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, context.slot_mapping)
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
