"""Batched decode attention and the paged path against SDPA over each sequence's whole context."""
import pytest
import torch
import torch.nn.functional as F

from cpumoe.models.blocks import AttentionContext, paged_attention

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _case(query_lens, context_lens, nh, nkv, d, dtype, block_size=4):
    g = torch.Generator().manual_seed(len(query_lens) * 31 + sum(context_lens))
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, nkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, nkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks
    tables = []
    for c in context_lens:
        n = -(-c // block_size)
        tables.append(torch.tensor(perm[:n], dtype=torch.long))
        perm = perm[n:]
    q = torch.randn(sum(query_lens), nh, d, generator=g).to(dtype)
    context = AttentionContext(positions=torch.zeros(q.shape[0], dtype=torch.long), query_lens=list(query_lens),
                               context_lens=list(context_lens), slot_mapping=torch.zeros(0, dtype=torch.long),
                               block_tables=tables, kv_caches=[(k_cache, v_cache)])
    return q, k_cache, v_cache, context


def _reference(q, k_cache, v_cache, context):
    out, start = [], 0
    nh, nkv, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    for q_len, ctx, blocks in zip(context.query_lens, context.context_lens, context.block_tables):
        k = k_cache[blocks].reshape(-1, nkv, d)[:ctx].transpose(0, 1).float().repeat_interleave(nh // nkv, 0)
        v = v_cache[blocks].reshape(-1, nkv, d)[:ctx].transpose(0, 1).float().repeat_interleave(nh // nkv, 0)
        mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(diagonal=ctx - q_len)
        qi = q[start:start + q_len].transpose(0, 1).float()
        out.append(F.scaled_dot_product_attention(qi, k, v, attn_mask=mask).transpose(0, 1))
        start += q_len
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("query_lens,context_lens", [
    ([1], [1]), ([1], [17]), ([1, 1, 1], [5, 39, 1]),              # decodes only
    ([1, 7, 1], [9, 7, 33]), ([5, 1], [13, 6]), ([3], [3]),        # decodes beside prefills and chunks
], ids=["one-token", "decode-17", "decodes-3", "mixed", "chunk-then-decode", "prefill-only"])
@pytest.mark.parametrize("nh,nkv", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_paged_attention_matches_sdpa(query_lens, context_lens, nh, nkv, dtype):
    q, k_cache, v_cache, context = _case(query_lens, context_lens, nh, nkv, 16, dtype)
    out = paged_attention(q, k_cache, v_cache, context)
    torch.testing.assert_close(out.float(), _reference(q, k_cache, v_cache, context), **TOL[dtype],
                               msg=f"query_lens {query_lens}, context_lens {context_lens}")
