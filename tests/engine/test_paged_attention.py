"""Batched decode attention and the paged path against SDPA over each sequence's whole context."""
import pytest
import torch
import torch.nn.functional as F

from cpumoe.attention import paged_attention
from tests.engine.paged import paged_case

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


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
    q, k_cache, v_cache, context = paged_case(query_lens, context_lens, nh=nh, nkv=nkv, d=16, dtype=dtype)
    out = paged_attention(q, k_cache, v_cache, context)
    torch.testing.assert_close(out.float(), _reference(q, k_cache, v_cache, context), **TOL[dtype],
                               msg=f"query_lens {query_lens}, context_lens {context_lens}")


@pytest.mark.parametrize("context_lens", [[1], [17], [5, 39, 1, 4], [8, 8]], ids=["one-token", "decode-17",
                                                                                  "decodes-4", "full-blocks"])
def test_a_decode_steps_context_in_one_tensor_is_the_general_one(context_lens):
    """AttentionContext.for_decode (the runner's all-decode steps) gives the tensors the general path builds."""
    from cpumoe.attention import AttentionContext, DecodeBatch
    q, k_cache, v_cache, general = paged_case([1] * len(context_lens), context_lens, nh=8, nkv=2, d=16,
                                              dtype=torch.bfloat16)
    bs = k_cache.shape[1]
    tables = [t.tolist() for t in general.block_tables]
    token_ids = [100 + i for i in range(len(context_lens))]
    ids, context = AttentionContext.for_decode(token_ids, context_lens, tables, bs, general.kv_caches)
    positions = [c - 1 for c in context_lens]
    assert ids.tolist() == token_ids and context.positions.tolist() == positions
    assert context.slot_mapping.tolist() == [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
    assert context.query_lens == [1] * len(context_lens) and context.context_lens == context_lens
    assert [t.tolist() for t in context.block_tables] == tables
    for t in (ids, context.positions, context.slot_mapping):
        assert t.dtype == torch.long and t.is_contiguous()
    built, ours = DecodeBatch.build(general, list(range(len(context_lens)))), context.decode_batch()
    for name in ("block_table", "lens", "key_begin", "key_end"):
        assert torch.equal(getattr(ours, name), getattr(built, name)), name
        assert getattr(ours, name).is_contiguous()
    assert (ours.token_index, ours.seq_rows, ours.block_size) == (built.token_index, built.seq_rows, built.block_size)
    assert torch.equal(paged_attention(q, k_cache, v_cache, context), paged_attention(q, k_cache, v_cache, general))
