"""ops.rope_and_cache against the torch maths it replaces (apply_rotary on q and k, then index_put of k and v into
the paged cache; with q_norm and k_norm, the per-head RMSNorm before them): bit for bit in float32, bf16 and fp16
over a grid of token counts, head counts and sizes, shuffled slots; bad inputs are refused by name; the fake kernel
traces shapes."""
import pytest
import torch

from cpumoe import ops
from cpumoe.models.blocks import RotaryEmbedding, apply_rotary, rms_norm_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def case(T, nh, nkv, d, dv, dtype, blocks=9, block_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, nh, d, generator=g).to(dtype)
    k = torch.randn(T, nkv, d, generator=g).to(dtype)
    v = torch.randn(T, nkv, dv, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (T,), generator=g)
    cos, sin = RotaryEmbedding(d, 1e6)(positions, dtype)                       # [T, d]
    k_cache = torch.randn(blocks, block_size, nkv, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, block_size, nkv, dv, generator=g).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=g)[:T]
    return q, k, v, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("T", [1, 5, 17])
@pytest.mark.parametrize("nh,nkv,d,dv", [(4, 2, 64, 64), (8, 1, 128, 128), (3, 3, 2, 2), (6, 2, 32, 48)],
                         ids=["gqa-64", "mqa-128", "d2", "v-wider"])
def test_matches_the_torch_ops_bit_for_bit(dtype, T, nh, nkv, d, dv):
    q, k, v, cos, sin, k_cache, v_cache, slots = case(T, nh, nkv, d, dv, dtype)
    want_q, want_k = apply_rotary(q, cos[:, None], sin[:, None]), apply_rotary(k, cos[:, None], sin[:, None])
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    want_kc.view(-1, nkv, d)[slots] = want_k
    want_vc.view(-1, nkv, dv)[slots] = v
    ops.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(q, want_q), f"q: max diff {(q.float() - want_q.float()).abs().max()}"
    assert torch.equal(k, want_k), f"k: max diff {(k.float() - want_k.float()).abs().max()}"
    assert torch.equal(k_cache, want_kc) and torch.equal(v_cache, want_vc), "cache rows"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("T", [1, 5, 17])
@pytest.mark.parametrize("nh,nkv,d", [(4, 2, 64), (8, 1, 128), (3, 3, 2), (6, 2, 40)],
                         ids=["gqa-64", "mqa-128", "d2", "d40-tail"])
def test_head_norms_match_rms_norm_then_rotary_bit_for_bit(dtype, T, nh, nkv, d):
    """Qwen3's per-head q/k RMSNorm folded in: as the rms_norm op (and transformers) computes it, then RoPE. d = 40
    sums a 16-wide body and a tail, as rms_norm does."""
    q, k, v, cos, sin, k_cache, v_cache, slots = case(T, nh, nkv, d, d, dtype)
    g = torch.Generator().manual_seed(T + d)
    q_norm, k_norm = ((torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2))
    eps = 1e-5
    normed_q, normed_k = ops.rms_norm(q, q_norm, eps), ops.rms_norm(k, k_norm, eps)
    # the op is transformers' maths, up to the float32 sum's order (tests/kernels/test_rms_norm.py)
    torch.testing.assert_close(normed_q, rms_norm_reference(q, q_norm, eps))
    want_q = apply_rotary(normed_q, cos[:, None], sin[:, None])
    want_k = apply_rotary(normed_k, cos[:, None], sin[:, None])
    want_kc = k_cache.clone()
    want_kc.view(-1, nkv, d)[slots] = want_k
    ops.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm, k_norm, eps)
    assert torch.equal(q, want_q), f"q: max diff {(q.float() - want_q.float()).abs().max()}"
    assert torch.equal(k, want_k), f"k: max diff {(k.float() - want_k.float()).abs().max()}"
    assert torch.equal(k_cache, want_kc), "cache rows"


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(q_norm=torch.ones(8, dtype=torch.bfloat16)), "q_norm and k_norm are given together"),
    (lambda a: a.update(q_norm=torch.ones(8), k_norm=torch.ones(8)), "q_norm must be BFloat16 \\[8\\]"),
    (lambda a: a.update(q_norm=torch.ones(8, dtype=torch.bfloat16), k_norm=torch.ones(4, dtype=torch.bfloat16)),
     "k_norm must be .*\\[8\\] \\(a head's RMSNorm weight\\)"),

    (lambda a: a.update(k=a["k"].float()), "k must be"),
    (lambda a: a.update(cos=a["cos"][:, :-2].contiguous(), sin=a["sin"][:, :-2].contiguous()), "cos and sin must be"),
    (lambda a: a.update(v=a["v"][:, :1].contiguous()), "v \\["),
    (lambda a: a.update(slot_mapping=torch.tensor([0, 36, 1])), "slot_mapping\\[1\\] = 36 is outside the cache's 36"),
    (lambda a: a.update(slot_mapping=torch.tensor([0, -1, 1])), "outside the cache"),
    (lambda a: a.update(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)), "slot_mapping must be int64"),
    (lambda a: a.update(k_cache=a["k_cache"][..., :1, :].contiguous()), "k_cache must be"),
    (lambda a: a.update(q=a["q"].transpose(0, 1)), "q must be contiguous"),
])
def test_bad_inputs_are_refused_by_name(change, message):
    q, k, v, cos, sin, k_cache, v_cache, slots = case(3, 4, 2, 8, 8, torch.bfloat16)
    args = dict(q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    change(args)
    with pytest.raises((ValueError, RuntimeError), match=message):   # layout checks raise RuntimeError
        ops.rope_and_cache(**args)


def test_odd_head_size_is_refused():
    q, k, v = torch.randn(2, 2, 3), torch.randn(2, 1, 3), torch.randn(2, 1, 3)
    cos, sin = torch.randn(2, 3), torch.randn(2, 3)
    k_cache, v_cache, slots = torch.zeros(2, 4, 1, 3), torch.zeros(2, 4, 1, 3), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="head size must be even"):
        ops.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots)


def test_head_size_above_1024_is_refused():
    """The kernel normalizes a head through a stack buffer of 1024 values: a larger head is named, not overrun."""
    d = 1026
    q, k, v = torch.randn(2, 2, d), torch.randn(2, 1, d), torch.randn(2, 1, d)
    cos, sin = torch.randn(2, d), torch.randn(2, d)
    k_cache, v_cache, slots = torch.zeros(2, 4, 1, d), torch.zeros(2, 4, 1, d), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="head dim 1026 above 1024"):
        ops.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots)


def test_fake_kernel_and_meta_weights():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k, v, cos, sin, k_cache, v_cache, slots = case(2, 4, 2, 8, 8, torch.bfloat16)
        ops.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots)
        norm = torch.ones(8, dtype=torch.bfloat16)
        ops.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots, norm, norm, 1e-6)
    q, k, v, cos, sin, k_cache, v_cache, slots = case(2, 4, 2, 8, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="k_cache, v_cache are meta tensors"):
        ops.rope_and_cache(q, k, v, cos, sin, k_cache.to("meta"), v_cache.to("meta"), slots)
