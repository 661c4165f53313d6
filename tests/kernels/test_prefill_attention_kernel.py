"""ops.prefill_attention (csrc/core/prefill_attention.h, x86-amx) against causal_attention_reference (full score
matrix in float32, explicit masks) over a grid: GQA group sizes, first chunks and later ones (T < L), one query,
odd lengths around the kernel's 16-query tiles and 32-key steps, head sizes 32-128 with V wider or narrower than
K, sliding windows, sinks, strided inputs; a NaN score; bad input.

Tolerance, relative to max |ref|: bf16 1e-2 (scores and softmax in float32, the probabilities rounded to bf16 before
they weight the values, the output rounded to bf16)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cpumoe import ops
from cpumoe.attention.prefill import causal_attention_reference

BACKEND = ops.prefill_attention_backend()
needs_kernel = pytest.mark.skipif(not BACKEND, reason="no kernel backend here has a prefill attention kernel")
TOLERANCE = 1e-2

CASES = [  # (nh, nkv, T, L, d, dv)
    (4, 4, 1, 1, 32, 32), (8, 2, 5, 5, 32, 32), (6, 1, 17, 17, 64, 96), (8, 4, 130, 130, 32, 64),
    (4, 2, 7, 20, 32, 32), (8, 2, 1, 33, 64, 32), (4, 1, 16, 47, 128, 128), (32, 4, 100, 100, 128, 128),
    (2, 2, 33, 300, 64, 64),
]


def inputs(nh, nkv, T, L, d, dv, seed=0, sinks=False):
    g = torch.Generator().manual_seed(seed * 1009 + T * 31 + L)
    q = torch.randn(nh, T, d, generator=g).bfloat16()
    k = torch.randn(nkv, L, d, generator=g).bfloat16()
    v = torch.randn(nkv, L, dv, generator=g).bfloat16()
    return q, k, v, (torch.randn(nh, generator=g) * 2 if sinks else None)


def check(out, ref):
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < TOLERANCE, err


@needs_kernel
@pytest.mark.parametrize("window", [0, 3, 50])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "nh{}-nkv{}-T{}-L{}-d{}-dv{}".format(*c))
def test_matches_reference(case, window, with_sinks):
    nh, nkv, T, L, d, dv = case
    q, k, v, sinks = inputs(*case, sinks=with_sinks)
    scale = d ** -0.5
    out = ops.prefill_attention(q, k, v, scale, window=window, sinks=sinks)
    check(out, causal_attention_reference(q, k, v, scale=scale, sliding_window=window or None, sinks=sinks))


@needs_kernel
def test_strided_inputs():
    """Token-major memory seen head-major, as the paged cache's gathered keys and a chunk's queries are."""
    T, L, nh, nkv, d = 40, 72, 8, 2, 64
    q_tokens, k_tokens, v_tokens = (torch.randn(n, h, d).bfloat16() for n, h in ((T, nh), (L, nkv), (L, nkv)))
    q, k, v = q_tokens.transpose(0, 1), k_tokens.transpose(0, 1), v_tokens.transpose(0, 1)
    out = ops.prefill_attention(q, k, v, 0.125)
    check(out, causal_attention_reference(q, k, v, scale=0.125))
    torch.testing.assert_close(out, ops.prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.125),
                               rtol=0, atol=0)


@needs_kernel
def test_rows_do_not_depend_on_the_chunking():
    """A query's output is the same whether its chunk is the whole prompt or the prompt's last part."""
    q, k, v, _ = inputs(8, 2, 100, 100, 64, 64)
    whole = ops.prefill_attention(q, k, v, 0.125)
    for T in (1, 15, 33, 64):
        torch.testing.assert_close(ops.prefill_attention(q[:, -T:], k, v, 0.125), whole[:, -T:], rtol=0, atol=0)


@needs_kernel
def test_nan_score_gives_a_nan_row_only():
    q, k, v, _ = inputs(4, 2, 20, 20, 32, 32)
    k[0, 5, 3] = float("nan")  # key 5 of KV head 0: heads 0-1's queries from position 5 on
    out = ops.prefill_attention(q, k, v, 0.2)
    assert out[:2, 5:].isnan().all() and not out[:2, :5].isnan().any() and not out[2:].isnan().any()


@needs_kernel
def test_bad_input_raises():
    q, k, v, _ = inputs(4, 2, 8, 8, 32, 32)
    with pytest.raises(ValueError, match="do not fit"):
        ops.prefill_attention(q[:3], k, v, 1.0)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="queries over"):
        ops.prefill_attention(q, k[:, :4], v[:, :4], 1.0)  # T > L
    with pytest.raises(ValueError, match="float32"):
        ops.prefill_attention(q, k, v, 1.0, sinks=torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rows must be contiguous"):
        ops.prefill_attention(q.transpose(1, 2), k, v, 1.0)
    with pytest.raises(ValueError, match="like q"):
        ops.prefill_attention(q, k.float(), v, 1.0)
    with pytest.raises(ValueError, match="bf16"):
        ops.prefill_attention(q.half(), k.half(), v.half(), 1.0)
    with pytest.raises(ValueError, match="multiples of 32"):
        ops.prefill_attention(q[..., :16], k[..., :16], v, 1.0)
    with pytest.raises(ValueError, match="window"):
        ops.prefill_attention(q, k, v, 1.0, window=-1)


def test_refusal_names_the_reason():
    if BACKEND:
        assert ops.prefill_attention_refusal(torch.bfloat16, 128, 64) == ""
        assert "bf16" in ops.prefill_attention_refusal(torch.float32, 128, 128)
        assert "multiples of 32" in ops.prefill_attention_refusal(torch.bfloat16, 80, 64)
    else:
        assert "no backend here" in ops.prefill_attention_refusal(torch.bfloat16, 128, 128)
    assert "not int8" in ops.prefill_attention_refusal(torch.int8, 128, 128)


@pytest.mark.skipif(bool(BACKEND), reason="this machine has a prefill attention kernel")
def test_no_kernel_says_why():
    q, k, v, _ = inputs(4, 2, 8, 8, 32, 32)
    with pytest.raises(ValueError, match="no backend here"):
        ops.prefill_attention(q, k, v, 1.0)


def test_fake_kernel_shape():
    with FakeTensorMode():
        q, k, v = torch.empty(8, 5, 64), torch.empty(2, 9, 64), torch.empty(2, 9, 32)
        out = ops.prefill_attention(q, k, v, 1.0)
    assert out.shape == (8, 5, 32) and out.stride() == (32, 8 * 32, 1)  # token-major memory, as the kernel's
