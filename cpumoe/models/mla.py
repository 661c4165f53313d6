"""Multi-head latent attention (MLA, DeepSeek-V2 and V3), numerics as transformers' DeepseekV2Attention (and
DeepseekV3Attention, which rotates in the model dtype where this rotates in float32: the same in fp32).

    x -> q_proj                                  (q_lora_rank None)
      |  q_a_proj -> q_a_layernorm -> q_b_proj    (q_lora_rank set)      -> q [.., nh, nope + rope]
    x -> kv_a_proj_with_mqa -> [latent c, k_pe]; kv_b_proj(kv_a_layernorm(c)) -> [k_nope, v] per head
    RoPE on the rope parts only (q_pe per head, k_pe shared by all heads), on interleaved pairs (x[2i], x[2i+1]),
    or, with rope_interleave False (a DeepSeek-V3 config option), on the halves' pairs (x[i], x[i + r/2])
    k = [k_nope | k_pe], attention with scale (nope + rope)^-0.5, o_proj over nh * v_head_dim.

RoPE: default or scaled (rope.py; the published DeepSeek-V2 checkpoints use yarn), as transformers 5.24's
DeepseekV2: inv_freq and the attention factor over the qk_rope_head_dim channels from the rope init function, cos
and sin multiplied by that factor (so q_pe and k_pe both are; 1 for DeepSeek-V2, whose mscale == mscale_all_dim),
and, for any rope type but default with mscale_all_dim set, the softmax scale multiplied by
yarn_mscale(factor, mscale_all_dim)^2 (transformers' yarn_apply_mscale).

The paged cache holds MLA's compressed form, one (c + r)-vector per token and layer shared by all heads: the normed
latent and the rotated k_pe (KVCacheLayout(1, c + r, 0): no V tensor, the values are the latent itself), instead of
every head's K and V. With W_UK [nh, nope, c] and W_UV [nh, dv, c] the halves of kv_b_proj,
    q_nope . k_nope = q_nope . (W_UK latent) = (q_nope W_UK) . latent,    sum_t p_t v_t = W_UV (sum_t p_t latent_t)
so decode absorbs W_UK into the query and W_UV into the output and attends over the cache as MQA with one
(c + r)-dim key per token whose first c channels are also its value; a prefill chunk (more FLOPs per key that way)
instead expands its context's K and V from the cached latent through kv_b_proj and calls SDPA, as transformers does.
Batch-invariant (make_batch_invariant): every token, prefill or decode, takes the absorbed form as a row of its own
(the decode kernel over the latent cache, the absorptions on per-head packed copies of W_UK and W_UV), so its
result never depends on the other tokens of its step or on its prompt's chunking.
Shapes: T tokens, S decoding sequences, nh heads, c kv_lora_rank, r qk_rope_head_dim, nope qk_nope_head_dim,
dqk = nope + r, dv v_head_dim, L cached tokens.
"""
from __future__ import annotations

import torch
from torch import nn

from cpumoe import torch_gemm
from cpumoe.attention import KVCacheLayout
from cpumoe.attention import AttentionContext, DecodeBatch, row_attention
from cpumoe.models.blocks import RMSNorm
from cpumoe.models.packed_linear import PackedLinear
from cpumoe.models.rope import rope_parameters, rope_type, yarn_mscale

# transformers builds q_a_layernorm / kv_a_layernorm with DeepseekV2RMSNorm's default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos, sin [T, r/2] (one angle per channel pair) of positions [T] * inv_freq [r/2], times the attention
    factor (transformers: polar(1, freqs) * attention_scaling)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, r/2]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """qk_head_dim^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 for a scaled RoPE with mscale_all_dim
    (transformers' yarn_apply_mscale, in its order of operations)."""
    scale = qk_head_dim ** -0.5
    if rope_type(rope_scaling) != "default" and rope_scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[2i], x[2i+1]) by angle i, in float32 (transformers' complex multiply); x [..., r],
    cos and sin broadcastable to [..., r/2]. transformers' DeepseekV3 writes the rotated pairs de-interleaved
    (evens, then odds); q_pe and k_pe share the order, so q . k is the same."""
    xf = x.float().unflatten(-1, (-1, 2))  # [..., r/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # [..., r/2, 2]
    return out.flatten(-2).to(x.dtype)


def apply_rotary_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + r/2]) by angle i, in float32 (rotate_half, as Llama); x [..., r], cos and sin
    broadcastable to [..., r/2]."""
    x0, x1 = x.float().chunk(2, dim=-1)  # [..., r/2] each
    return torch.cat((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).to(x.dtype)


class LatentUpProjection(nn.Module):
    """kv_b_proj: normed latent [.., c] -> per head [k_nope | v] [.., nh * (nope + dv)]; weight [nh * (nope + dv), c].
    Not an nn.Linear on purpose: pack_linears would swap that for a packed copy without `.weight`, and decode needs
    the weight's halves W_UK, W_UV as matrices to absorb them."""

    def __init__(self, kv_lora_rank: int, num_heads: int, qk_nope_head_dim: int, v_head_dim: int):
        super().__init__()
        self.num_heads, self.nope, self.v_head_dim = num_heads, qk_nope_head_dim, v_head_dim
        self.weight = nn.Parameter(torch.empty(num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank))
        self.query_heads: nn.ModuleList | None = None  # batch-invariant: per head, W_UK^T and W_UV packed
        self.value_heads: nn.ModuleList | None = None

    def make_batch_invariant(self) -> None:
        """Pack each head's W_UK^T [c, nope] and W_UV [dv, c] for cpumoe's linear kernel (absorb_query,
        expand_values), whose rows do not depend on how many there are, unlike torch's batched matmul."""
        w_uk, w_uv = self.absorbed()
        self.query_heads = nn.ModuleList(PackedLinear(w.t().contiguous()) for w in w_uk)
        self.value_heads = nn.ModuleList(PackedLinear(w.contiguous()) for w in w_uv)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, nh, nope] -> q_nope W_UK [T, nh, c], head by head on the packed copies."""
        return torch.stack([head(q_nope[:, h]) for h, head in enumerate(self.query_heads)], dim=1)

    def expand_values(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [T, nh, c] -> W_UV o_lat [T, nh, dv], head by head on the packed copies."""
        return torch.stack([head(o_lat[:, h]) for h, head in enumerate(self.value_heads)], dim=1)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return torch_gemm.linear(latent, self.weight)

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [nh, nope, c] and W_UV [nh, dv, c], views of the weight."""
        w = self.weight.view(self.num_heads, self.nope + self.v_head_dim, -1)  # [nh, nope + dv, c]
        return w[:, :self.nope], w[:, self.nope:]

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


class MLAttention(nn.Module):
    """forward(x [B, T, H], positions [T]): whole sequences, no cache; forward(x [T, H], positions, context, layer):
    the engine's flat tokens, their latent into layer `layer` of the paged cache (see the module docstring)."""

    def __init__(self, *, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope_theta: float,
                 bias: bool = False, rope_scaling: dict | None = None, rope_interleave: bool = True):
        super().__init__()
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={qk_rope_head_dim} must be even")
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.rope_interleave = rope_interleave
        self._rotate = apply_rotary_interleaved if rope_interleave else apply_rotary_halves
        # plain float32 CPU tensor, not a buffer (built on the meta device; stays fp32)
        self.inv_freq, self.rope_attention_factor = rope_parameters(qk_rope_head_dim, rope_theta, rope_scaling)
        self.scaling = softmax_scale(self.qk_head_dim, rope_scaling)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.qk_head_dim, bias=False)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(kv_lora_rank, num_heads, qk_nope_head_dim, v_head_dim)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)

    @staticmethod
    def cache_layout(kv_lora_rank: int, qk_rope_head_dim: int) -> KVCacheLayout:
        """One (latent | k_pe) vector per token and layer; no V."""
        return KVCacheLayout(num_kv_heads=1, k_dim=kv_lora_rank + qk_rope_head_dim, v_dim=0)

    def _project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., T, H], positions [T] -> q_nope [..., T, nh, nope], q_pe [..., T, nh, r] (RoPE applied),
        latent [..., T, c] (normed), k_pe [..., T, r] (RoPE applied)."""
        lead, nh = x.shape[:-1], self.num_heads
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(*lead, nh, self.qk_head_dim).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)  # [.., c], [.., r]
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_attention_factor)  # [T, r/2]
        q_pe = self._rotate(q_pe, cos[:, None], sin[:, None])  # [..., T, nh, r]
        k_pe = self._rotate(k_pe, cos, sin)  # [..., T, r]
        return q_nope, q_pe, self.kv_a_layernorm(latent), k_pe

    def _expand(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [..., L, c], k_pe [..., L, r] -> k [..., L, nh, dqk] (k_pe shared by the heads),
        v [..., L, nh, dv]."""
        lead, nh = latent.shape[:-1], self.num_heads
        kv = self.kv_b_proj(latent).view(*lead, nh, self.nope + self.v_head_dim)
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)  # [..., L, nh, nope], [..., L, nh, dv]
        k = torch.cat((k_nope, k_pe.unsqueeze(-2).expand(*lead, nh, self.rope)), dim=-1)  # [..., L, nh, dqk]
        return k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext | None = None,
                layer: int = 0) -> torch.Tensor:
        if context is not None:
            return self._forward_paged(x, positions, context, layer)
        B, T, _ = x.shape  # x [B, T, H], positions [T]
        q_nope, q_pe, latent, k_pe = self._project(x, positions)
        k, v = self._expand(latent, k_pe)  # [B, T, nh, dqk], [B, T, nh, dv]
        q = torch.cat((q_nope, q_pe), dim=-1)  # [B, T, nh, dqk]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, nh, T, d*]
        out = torch_gemm.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)  # [B, nh, T, dv]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.v_head_dim))  # [B, T, H]

    def _forward_paged(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext,
                       layer: int) -> torch.Tensor:  # x [T, H], positions [T]
        T, nh, c, width = x.shape[0], self.num_heads, self.kv_lora_rank, self.kv_lora_rank + self.rope
        q_nope, q_pe, latent, k_pe = self._project(x, positions)  # [T, nh, nope], [T, nh, r], [T, c], [T, r]
        cache = context.kv_caches[layer][0]  # [num_blocks, block_size, 1, c + r]
        if cache.shape[-2:] != (1, width):
            raise ValueError(f"layer {layer}'s KV cache is [.., {cache.shape[-2]}, {cache.shape[-1]}], MLA's latent "
                             f"cache needs [.., 1, kv_lora_rank + qk_rope_head_dim = {width}]")
        cache.view(-1, width)[context.slot_mapping] = torch.cat((latent, k_pe), dim=-1).to(cache.dtype)
        if self.kv_b_proj.query_heads is not None:  # batch-invariant: every token absorbed, a row of its own
            return self.o_proj(self._rows(q_nope, q_pe, cache, context).reshape(T, nh * self.v_head_dim))
        out = x.new_empty(T, nh, self.v_head_dim)  # [T, nh, dv]
        decode = context.decode_batch()
        if decode is not None:
            rows = slice(None) if decode.token_index is None else decode.token_index
            out[rows] = self._decode(q_nope[rows], q_pe[rows], cache, decode)
        q = torch.cat((q_nope, q_pe), dim=-1)  # [T, nh, dqk]
        start = 0
        for q_len, ctx_len, blocks in zip(context.query_lens, context.context_lens, context.block_tables):
            if q_len > 1:  # a prefill chunk: expand K/V for its whole context
                ctx = cache[blocks].view(-1, width)[:ctx_len]  # [ctx, c + r]
                k, v = self._expand(ctx[:, :c], ctx[:, c:])  # [ctx, nh, dqk], [ctx, nh, dv]
                qi, k, v = (t.transpose(0, 1)[None] for t in (q[start:start + q_len], k, v))  # [1, nh, len, d*]
                # query j sees keys up to ctx_len - q_len + j (bottom-right causal; plain causal for a whole prompt)
                mask = None if q_len == ctx_len else torch.ones(q_len, ctx_len, dtype=torch.bool).tril(ctx_len - q_len)
                o = torch_gemm.scaled_dot_product_attention(qi, k, v, attn_mask=mask, is_causal=mask is None,
                                                            scale=self.scaling)
                out[start:start + q_len] = o[0].transpose(0, 1)  # [q_len, nh, dv]
            start += q_len
        return self.o_proj(out.reshape(T, nh * self.v_head_dim))  # [T, H]

    def _rows(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
              context: AttentionContext) -> torch.Tensor:
        """Batch-invariant MLA: every token, prefill or decode, absorbed (as _decode) and attended over the latent
        cache by the decode kernel as a row of its own (cpumoe.attention.row_attention; the values are the first c channels
        of the keys). q_nope [T, nh, nope], q_pe [T, nh, r] -> [T, nh, dv]."""
        q = torch.cat((self.kv_b_proj.absorb_query(q_nope), q_pe), dim=-1)  # [T, nh, c + r]
        o_lat = row_attention(q, cache, cache[..., :self.kv_lora_rank], context, scale=self.scaling)  # [T, nh, c]
        return self.kv_b_proj.expand_values(o_lat)

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                batch: DecodeBatch) -> torch.Tensor:
        """Absorbed MLA over the latent cache, one query per sequence: q_nope [S, nh, nope], q_pe [S, nh, r],
        cache [num_blocks, block_size, 1, c + r] -> [S, nh, dv]. The absorptions run in the model dtype (as
        kv_b_proj does in the expanded form); scores, softmax and the weighted sum of latents in float32."""
        S, c = q_nope.shape[0], self.kv_lora_rank
        w_uk, w_uv = self.kv_b_proj.absorbed()  # [nh, nope, c], [nh, dv, c]
        q_lat = torch_gemm.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [S, nh, c]
        q = torch.cat((q_lat, q_pe), dim=-1).float() * self.scaling  # [S, nh, c + r]
        kv = cache[batch.block_table].view(S, -1, c + self.rope).float()  # [S, L, c + r]
        scores = torch.matmul(q, kv.transpose(1, 2))  # [S, nh, L]
        scores.masked_fill_(~batch.valid.view(S, 1, -1), float("-inf"))
        o_lat = torch.matmul(scores.softmax(dim=-1), kv[..., :c]).to(q_nope.dtype)  # [S, nh, c]
        return torch_gemm.matmul(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [S, nh, dv]

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
                f"nope={self.nope}, rope={self.rope}, v={self.v_head_dim}, rope_scaling={self.rope_scaling}"
                + ("" if self.rope_interleave else ", rope_interleave=False"))
