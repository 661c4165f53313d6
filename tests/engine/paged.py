"""Random paged-attention inputs, shared by the engine's and the models' attention tests."""
import torch

from cpumoe.attention import AttentionContext


def paged_case(query_lens, context_lens, *, nh: int, nkv: int, d: int, dtype: torch.dtype, block_size: int = 4,
               seed: int | None = None):
    """q [sum(query_lens), nh, d], K/V caches with each sequence's blocks scattered, and the AttentionContext of one
    step in which sequence i has query_lens[i] new tokens of context_lens[i]. -> (q, k_cache, v_cache, context)"""
    seed = len(query_lens) * 31 + sum(context_lens) if seed is None else seed
    g = torch.Generator().manual_seed(seed)
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
