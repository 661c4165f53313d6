"""ops.causal_softmax against the torch maths it replaces in the prefill attention (a float32 copy of the scores,
the scale, the causal and window masks, softmax with an optional sink logit in the denominator, the cast back),
over a grid of dtypes, head and query counts, odd key counts, chunk offsets, windows and sinks. The kernel's exp is
cpumoe's polynomial, not torch's, so the two agree to a few float32 ulp before the cast: tolerances per dtype
below. Hidden keys get exactly 0. Bad inputs are refused by name; the fake kernel traces shapes."""
import pytest
import torch

from cpumoe import ops

# float32: a few ulp of the exp and the sum's order; bf16 / fp16: one unit in the last place of the cast
TOLERANCE = {torch.float32: dict(rtol=2e-6, atol=1e-7), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-6),
             torch.float16: dict(rtol=2 ** -10, atol=1e-6)}


def visible(queries, keys, first_query, first_key, window):
    position = torch.arange(first_query, first_query + queries)[:, None]
    key = torch.arange(first_key, first_key + keys)[None, :]
    seen = key <= position
    if window:
        seen &= key > position - window
    return seen  # [queries, keys]


def reference(scores, scale, first_query, first_key, window=0, sinks=None):
    heads, queries, keys = scores.shape
    x = scores.float() * scale
    x = x.masked_fill(~visible(queries, keys, first_query, first_key, window), float("-inf"))
    if sinks is None:
        return x.softmax(-1).to(scores.dtype)
    sink = sinks.float().view(heads, 1, 1).expand(heads, queries, 1)
    return torch.cat((x, sink), dim=-1).softmax(-1)[..., :-1].to(scores.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("heads,queries,keys,first_query,first_key", [
    (4, 1, 1, 0, 0),          # a prompt's first token
    (8, 64, 64, 0, 0),        # a prompt's first block
    (3, 17, 100, 83, 0),      # a later block of a chunk, odd sizes
    (2, 5, 33, 40, 12),       # keys from a window's start
    (32, 64, 512, 448, 0),    # the last block of a 512-token prompt
], ids=["first-token", "block0", "odd", "keys-offset", "512-last-block"])
@pytest.mark.parametrize("window", [0, 7], ids=["causal", "window7"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_matches_the_torch_maths(dtype, heads, queries, keys, first_query, first_key, window, with_sinks):
    g = torch.Generator().manual_seed(heads * keys + queries)
    scores = (torch.randn(heads, queries, keys, generator=g) * 4).to(dtype)
    sinks = torch.randn(heads, generator=g) if with_sinks else None
    scale = 128 ** -0.5
    out = ops.causal_softmax(scores, scale, first_query, first_key, window=window, sinks=sinks)
    want = reference(scores, scale, first_query, first_key, window, sinks)
    assert out.dtype == dtype and out.shape == scores.shape
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCE[dtype])
    hidden = ~visible(queries, keys, first_query, first_key, window).expand(heads, -1, -1)
    assert torch.equal(out[hidden], torch.zeros_like(out[hidden])), "hidden keys get exactly 0"
    if not with_sinks:
        torch.testing.assert_close(out.float().sum(-1), torch.ones(heads, queries), rtol=0, atol=0.02)


def test_large_scores_do_not_overflow():
    """exp is taken of x - max: scores in the thousands (an unscaled dot product of large activations) give the
    softmax, not inf / nan."""
    scores = torch.tensor([[[3000.0, 2990.0, -5000.0]]])
    out = ops.causal_softmax(scores, 1.0, 2, 0)
    torch.testing.assert_close(out, reference(scores, 1.0, 2, 0), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_score_makes_its_row_nan_as_torch(bad):
    """The exp clamps its input, so a NaN would have turned into a number: the row is NaN instead, as torch's
    softmax gives it; the other rows are untouched. Both in the vector body and in the tail of a row."""
    scores = torch.randn(2, 3, 37, dtype=torch.bfloat16)
    scores[0, 2, 5] = bad   # body
    scores[1, 2, 33] = bad  # tail
    out = ops.causal_softmax(scores, 1.0, 34, 0)
    want = reference(scores, 1.0, 34, 0)
    assert out[0, 2].isnan().all() and out[1, 2].isnan().all() and want[0, 2].isnan().all()
    torch.testing.assert_close(out.float(), want.float(), equal_nan=True, **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("call,message", [
    (lambda s: ops.causal_softmax(s[0], 1.0, 3, 0), "scores must be 3-D"),
    (lambda s: ops.causal_softmax(s.transpose(1, 2), 1.0, 3, 0), "scores must be contiguous"),
    (lambda s: ops.causal_softmax(s.int(), 1.0, 3, 0), "scores must be float32, bfloat16 or float16"),
    (lambda s: ops.causal_softmax(s, 1.0, 3, 5), "the first query \\(position 3\\) sees no key"),
    (lambda s: ops.causal_softmax(s, 1.0, 4, 0),
     "the last query \\(position 6\\) is past the last key \\(position 5\\)"),
    (lambda s: ops.causal_softmax(s, 1.0, -1, 0), "must be >= 0"),
    (lambda s: ops.causal_softmax(s, 1.0, 3, 0, window=-3), "must be >= 0"),
    (lambda s: ops.causal_softmax(s, 1.0, 3, 0, sinks=torch.zeros(3)), "sinks must be float32 \\[2\\]"),
    (lambda s: ops.causal_softmax(s, 1.0, 3, 0, sinks=torch.zeros(2, dtype=torch.bfloat16)), "sinks must be float32"),
])
def test_bad_inputs_are_refused_by_name(call, message):
    with pytest.raises((ValueError, RuntimeError), match=message):  # layout checks raise RuntimeError
        call(torch.randn(2, 3, 6, dtype=torch.bfloat16))


def test_fake_kernel_and_meta_inputs():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        out = ops.causal_softmax(torch.randn(2, 3, 6, dtype=torch.bfloat16), 0.5, 3, 0, sinks=torch.zeros(2))
        assert out.shape == (2, 3, 6) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="sinks is a meta tensor"):
        ops.causal_softmax(torch.randn(2, 3, 6), 0.5, 3, 0, sinks=torch.zeros(2, device="meta"))
