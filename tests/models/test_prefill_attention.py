"""causal_attention against the plain maths (full score matrix, explicit masks, fp32): prompt and later chunks,
GQA group sizes, V wider or narrower than K, sliding windows, sinks; and against SDPA in bf16.

Tolerances, relative to max |ref|: fp32 1e-5; bf16 2e-2 (scores in fp32, probabilities rounded to bf16)."""
import pytest
import torch
import torch.nn.functional as F

from cpumoe import ops
from cpumoe.attention import prefill
from cpumoe.attention.prefill import BLOCK, causal_attention
from cpumoe.attention.prefill import causal_attention_reference as reference


CASES = [  # (nh, nkv, T, L, d, dv)
    (4, 4, 1, 1, 16, 16), (8, 2, 5, 5, 16, 16), (6, 1, BLOCK + 1, BLOCK + 1, 8, 12), (8, 4, 130, 130, 32, 16),
    (4, 2, 7, 20, 16, 16), (8, 2, 1, 33, 16, 16), (4, 1, 2 * BLOCK, 2 * BLOCK + 9, 16, 24),
]


@pytest.mark.parametrize("window", [None, 3, 50], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "nh{}-nkv{}-T{}-L{}-d{}-dv{}".format(*c))
def test_matches_reference_fp32(case, window, with_sinks):
    nh, nkv, T, L, d, dv = case
    g = torch.Generator().manual_seed(T * 31 + L)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((nh, T, d), (nkv, L, d), (nkv, L, dv)))
    sinks = torch.randn(nh, generator=g) if with_sinks else None
    out = causal_attention(q, k, v, sliding_window=window, sinks=sinks)
    ref = reference(q, k, v, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-5 * ref.abs().max().item(), rtol=0, msg=f"{case}")


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """bf16 chunks run the prefill attention kernel where there is one; "torch" forces the blocked torch maths."""
    if request.param == "kernel" and (why := ops.prefill_attention_refusal(torch.bfloat16, 64, 64)):
        pytest.skip(why)
    if request.param == "torch":
        monkeypatch.setattr(prefill, "_uses_kernel", lambda dtype, d, dv: False)
    return request.param


@pytest.mark.parametrize("T,L", [(1, 1), (100, 100), (40, 300)])
def test_bf16_matches_sdpa(T, L, path):
    g = torch.Generator().manual_seed(T)
    q = torch.randn(1, 8, T, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, L, 64, generator=g).bfloat16() for _ in range(2))
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=L - T)
    sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)[0]
    out = causal_attention(q[0], k[0], v[0], scale=64 ** -0.5)
    assert out.dtype == torch.bfloat16
    err = (out.float() - sdpa).abs().max() / sdpa.abs().max()
    assert err < 2e-2, err


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="do not fit"):
        causal_attention(torch.randn(3, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8))  # 3 heads over 2
    with pytest.raises(ValueError, match="do not fit"):
        causal_attention(torch.randn(2, 5, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8))  # T > L
