"""Paged attention over the engine's KV cache: decoding sequences in one kernel call (decode_attention), prefill
chunks through prefill.causal_attention (a one-pass kernel or blocked causal GEMMs), and the batch-invariant row
form (row_attention).
decode_attention_reference is the kernel's maths in torch, what its tests compare against."""
from __future__ import annotations

import torch

from cpumoe import ops
from cpumoe.attention.context import AttentionContext, DecodeBatch
from cpumoe.attention.prefill import causal_attention


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
                    sinks: torch.Tensor | None = None, sliding_window: int | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """Paged attention: all decoding sequences in one batched call (decode_attention); each prefill chunk gathers
    its cached K/V blocks and runs prefill.causal_attention (ops.prefill_attention where a backend has it, else
    blocked causal GEMMs; GQA without repeating K/V either way).
    q [T, nh, d]; k_cache, v_cache [num_blocks, block_size, nkv, d] -> [T, nh, d].
    With sinks [nh] (a per-head logit in the softmax denominator that adds no value, gpt-oss) or a sliding window
    (query at position p sees keys p - window < j <= p), decodes add the sink logit beside their scores and read only
    the window's blocks (DecodeBatch.windowed), and prefill chunks read only the keys some query sees.
    scale: of the scores, d^-0.5 by default."""
    decode = context.decode_batch()
    if decode is not None and sliding_window is not None:
        decode = decode.windowed(sliding_window)
    if decode is not None and decode.token_index is None:
        return decode_attention(q, k_cache, v_cache, decode, scale=scale, sinks=sinks)
    out = torch.empty_like(q)
    if decode is not None:
        out[decode.token_index] = decode_attention(q[decode.token_index], k_cache, v_cache, decode, scale=scale,
                                                   sinks=sinks)
    nkv, d, dv = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
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
        o = causal_attention(q[start:start + q_len].transpose(0, 1), k, v, scale=scale, sliding_window=sliding_window,
                             sinks=sinks)  # [nh, q_len, dv]
        out[start:start + q_len] = o.transpose(0, 1)  # [q_len, nh, dv]
        start += q_len
    return out
