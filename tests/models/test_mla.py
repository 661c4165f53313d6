"""MLAttention on the engine's latent cache against its own whole-sequence forward (no cache): every sequence's new
tokens, decodes (absorbed W_UK / W_UV over the latent) beside prefill chunks (K/V expanded from the latent), in one
step, give the rows the whole-sequence forward gives. The model-level comparison with transformers is in
test_deepseek_v2.py."""
import pytest
import torch

from cpumoe.engine.kv_cache import KVCache
from cpumoe.attention import AttentionContext
from cpumoe.models.mla import MLAttention

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
H, NH, C, NOPE, R, DV, BLOCK = 48, 4, 24, 16, 8, 12, 4
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
        "mscale_all_dim": 0.5}


def _mla(dtype, q_lora_rank, rope_scaling):
    torch.manual_seed(0)
    attn = MLAttention(hidden_size=H, num_heads=NH, q_lora_rank=q_lora_rank, kv_lora_rank=C, qk_nope_head_dim=NOPE,
                       qk_rope_head_dim=R, v_head_dim=DV, rope_theta=1e4, bias=True, rope_scaling=rope_scaling)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if p.dim() > 1:  # matrices [out, in]: unit-variance outputs
                p.copy_(torch.randn(p.shape) / p.shape[1] ** 0.5)
            else:  # norm weights around 1, biases around 0
                p.copy_(torch.randn(p.shape) * 0.3 + (1.0 if "layernorm" in name else 0.0))
    return attn.to(dtype).eval()


def _step(attn, xs, starts, ends, cache, tables):
    """One engine step: sequence i's tokens starts[i]:ends[i] (of xs[i]) with the ones before cached."""
    bs = cache.block_size
    slots = [tables[i][p // bs].item() * bs + p % bs for i in range(len(xs)) for p in range(starts[i], ends[i])]
    context = AttentionContext(
        positions=torch.tensor([p for s, e in zip(starts, ends) for p in range(s, e)]),
        query_lens=[e - s for s, e in zip(starts, ends)], context_lens=list(ends),
        slot_mapping=torch.tensor(slots), block_tables=[t[:-(-e // bs)] for t, e in zip(tables, ends)],
        kv_caches=cache.layers)
    x = torch.cat([x[s:e] for x, s, e in zip(xs, starts, ends)])  # [T, H]
    with torch.no_grad():
        return attn(x, context.positions, context, layer=0)  # [T, H]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("query_lens,context_lens", [
    ([1], [1]), ([1], [17]), ([1, 1, 1], [5, 39, 1]),          # decodes only
    ([1, 7, 1], [9, 7, 33]), ([5, 1], [13, 6]), ([3], [3]),    # decodes beside prefills and chunks
], ids=["one-token", "decode-17", "decodes-3", "mixed", "chunk-then-decode", "prefill-only"])
@pytest.mark.parametrize("q_lora_rank,rope_scaling", [(None, None), (20, YARN)], ids=["q-proj", "q-lora-yarn"])
def test_latent_cache_matches_whole_sequence(query_lens, context_lens, q_lora_rank, rope_scaling, dtype):
    attn = _mla(dtype, q_lora_rank, rope_scaling)
    g = torch.Generator().manual_seed(sum(context_lens))
    xs = [torch.randn(n, H, generator=g).to(dtype) for n in context_lens]
    num_blocks = sum(-(-n // BLOCK) for n in context_lens) + 2
    cache = KVCache(num_layers=1, num_blocks=num_blocks, block_size=BLOCK, layout=MLAttention.cache_layout(C, R),
                    dtype=dtype)
    assert cache.layers[0][0].shape == (num_blocks, BLOCK, 1, C + R) and cache.layers[0][1].numel() == 0
    perm = torch.randperm(num_blocks, generator=g)  # scattered blocks
    tables, used = [], 0
    for n in context_lens:
        tables.append(perm[used:used + -(-n // BLOCK)])
        used += -(-n // BLOCK)
    cached = [n - q for n, q in zip(context_lens, query_lens)]
    if any(cached):  # fill the cache first (a step of its own; empty rows for sequences with nothing cached)
        idx = [i for i, n in enumerate(cached) if n]
        _step(attn, [xs[i] for i in idx], [0] * len(idx), [cached[i] for i in idx], cache, [tables[i] for i in idx])
    out = _step(attn, xs, cached, context_lens, cache, tables)  # [T, H]
    with torch.no_grad():
        ref = torch.cat([attn(x[None], torch.arange(len(x)))[0, s:] for x, s in zip(xs, cached)])  # [T, H]
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype],
                               msg=f"query_lens {query_lens}, context_lens {context_lens}, {dtype}")
