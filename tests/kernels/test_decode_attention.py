"""The decode attention kernel (ops.decode_attention) against its torch reference (cpumoe.attention.decode_attention_reference)
on every backend that has one: GQA ratios (one query head per KV head to 20, past the kernel's 16-head groups), head
sizes that fill and do not fill a vector, V wider than K, block sizes, shuffled block tables, key windows that start
inside a block, one key, attention sinks; and the inputs it must refuse."""
import pytest
import torch

from cpumoe import _C, ops
from cpumoe.attention import DecodeBatch, decode_attention_reference
from tests.kernels.tolerances import assert_moe_close

BACKENDS = ops.attention_backends()


def make_case(S, nh, nkv, d, dv, block_size, lens, dtype, window=None, seed=0, sinks=False):
    g = torch.Generator().manual_seed(seed)
    n = max(-(-length // block_size) for length in lens)
    num_blocks = S * n + 3
    k_cache = torch.randn(num_blocks, block_size, nkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, nkv, dv, generator=g).to(dtype)
    # each sequence's blocks scattered over the cache, tables padded with block 0
    order = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(S, n, dtype=torch.long)
    for s, length in enumerate(lens):
        used = -(-length // block_size)
        table[s, :used] = order[s * n:s * n + used]
    lens_t = torch.tensor(lens, dtype=torch.long)
    key_end = lens_t
    key_begin = (lens_t - window).clamp(min=0) if window else torch.zeros_like(lens_t)
    pos = torch.arange(n * block_size)[None, :]
    valid = (pos < key_end[:, None]) & (pos >= key_begin[:, None])
    batch = DecodeBatch(token_index=None, block_table=table, seq_rows=list(range(S)), lens=lens_t,
                        block_size=block_size, key_begin=key_begin, key_end=key_end)
    assert torch.equal(batch.valid, valid[:, None, None, :])  # the mask the torch maths reads, made from the range
    q = torch.randn(S, nh, d, generator=g).to(dtype)
    sink = torch.randn(nh, generator=g) if sinks else None
    return q, k_cache, v_cache, batch, sink


CASES = [  # S, nh, nkv, d, dv, block_size, lens, window, sinks
    (1, 8, 2, 64, 64, 16, [1], None, False),               # one key
    (1, 32, 4, 128, 128, 16, [531], None, False),          # qwen3-30b-a3b's heads, an odd context
    (5, 8, 8, 64, 64, 16, [17, 1, 64, 33, 100], None, False),  # g = 1
    (3, 20, 1, 80, 80, 7, [40, 13, 77], None, True),       # g = 20 (two head groups), d not a vector multiple
    (2, 4, 2, 17, 33, 5, [9, 23], None, False),            # odd head sizes, V wider than K
    (4, 16, 4, 64, 64, 16, [200, 5, 130, 64], 48, True),   # a window starting inside a block, sinks (gpt-oss)
    (16, 32, 4, 128, 128, 16, [513 + 7 * i for i in range(16)], None, False),  # batch 16
    # head sizes a multiple of 32 (x86-avx512bf16's VDPBF16PS path in bf16): g = 20 in two head groups and in value
    # groups of 8, 8 and 4; a partial last tile of odd length; a window inside a block; sinks
    (3, 20, 1, 96, 64, 7, [40, 13, 77], None, True),
    (2, 6, 2, 64, 32, 16, [33, 95], 50, True),
    # block size 16 (x86-amx's tiles): g = 20 in a group of 16 heads and one of 4, a window from inside a block
    (3, 20, 1, 96, 64, 16, [40, 13, 77], 30, True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[0]}-h{c[1]}x{c[2]}-d{c[3]}v{c[4]}-bs{c[5]}"
                                                      f"{'-w' + str(c[7]) if c[7] else ''}{'-sinks' if c[8] else ''}")
def test_matches_reference(backend, dtype, case):
    S, nh, nkv, d, dv, bs, lens, window, sinks = case
    q, k_cache, v_cache, batch, sink = make_case(S, nh, nkv, d, dv, bs, lens, dtype, window, sinks=sinks)
    scale = d ** -0.5
    out = ops.decode_attention(q, k_cache, v_cache, batch.block_table, batch.key_begin, batch.key_end, scale, sink,
                               backend=backend)
    ref = decode_attention_reference(q, k_cache, v_cache, batch, scale=scale, sinks=sink)
    assert_moe_close(out, ref, dtype, f"{backend} {case}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [64, 80])
def test_weights_sum_to_one(backend, d):
    """Every value row the same: the output is that row, to the bit, whatever the scores (the denominator sums the
    weights the values were multiplied by, bf16-rounded ones included)."""
    q, k_cache, v_cache, batch, _ = make_case(3, 16, 2, d, d, 16, [1, 70, 300], torch.bfloat16)
    row = torch.randn(d).to(torch.bfloat16)
    v_cache[:] = row
    out = ops.decode_attention(q * 8, k_cache, v_cache, batch.block_table, batch.key_begin, batch.key_end, d ** -0.5,
                               backend=backend)
    assert torch.equal(out, row.expand_as(out))


def test_large_scores_stay_finite():
    """Scores of hundreds (a sharp softmax) must not overflow the running exponentials."""
    q, k_cache, v_cache, batch, _ = make_case(2, 8, 2, 64, 64, 16, [90, 33], torch.float32)
    out = ops.decode_attention(q * 40, k_cache, v_cache, batch.block_table, batch.key_begin, batch.key_end, 1.0)
    ref = decode_attention_reference(q * 40, k_cache, v_cache, batch, scale=1.0)
    assert torch.isfinite(out).all()
    assert_moe_close(out, ref, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width, values", [(40, 32), (96, 64)])
@pytest.mark.parametrize("block_size", [4, 16])  # 16: x86-amx's tiles, which read the rows in place
def test_values_as_a_view_of_the_keys_leading_channels(backend, width, values, block_size):
    """MLA's latent cache: one (c + r)-wide row per token whose first c channels are the values, passed as the view
    k_cache[..., :c] (row stride c + r); the same result as with a contiguous copy of it."""
    q, k_cache, _, batch, _ = make_case(3, 8, 1, width, 8, block_size, [1, 9, 40], torch.bfloat16)
    view = k_cache[..., :values]
    args = (batch.block_table, batch.key_begin, batch.key_end, 0.2)
    out = ops.decode_attention(q, k_cache, view, *args, backend=backend)
    assert torch.equal(out, ops.decode_attention(q, k_cache, view.contiguous(), *args, backend=backend))


def test_fake_kernel_shape():
    q, k_cache, v_cache, batch, _ = make_case(2, 4, 2, 16, 24, 4, [5, 9], torch.float32)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (q, k_cache, v_cache, batch.block_table, batch.key_begin, batch.key_end)]
        out = torch.ops.cpumoe.decode_attention(*args, 0.25, None)
    assert out.shape == (2, 4, 24) and out.dtype == torch.float32


def _args():
    q, k_cache, v_cache, batch, _ = make_case(2, 8, 2, 32, 32, 4, [6, 11], torch.bfloat16)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=batch.block_table, key_begin=batch.key_begin,
                key_end=batch.key_end, scale=0.2)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(k_cache=a["k_cache"].float()), "k_cache and v_cache must be"),
    (lambda a: a.update(q=a["q"][:, :7].contiguous()), "not a multiple"),
    (lambda a: a.update(q=a["q"][..., :16].contiguous()), "head size"),
    (lambda a: a.update(block_table=a["block_table"].int()), "int64"),
    (lambda a: a.update(key_end=a["key_end"] + 100), "outside its block table"),
    (lambda a: a.update(key_begin=a["key_end"] + 1), "outside its block table"),
    (lambda a: a["block_table"].__setitem__((0, 0), 10_000), "outside the cache"),
    (lambda a: a["block_table"].__setitem__((1, 0), -1), "outside the cache"),
    (lambda a: a.update(key_end=a["key_end"][:1]), "sequences"),
    (lambda a: a.update(sinks=torch.zeros(3)), "sinks must be"),
    (lambda a: a.update(q=a["q"].transpose(0, 1)), "contiguous"),
    (lambda a: a.update(v_cache=a["v_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
     "a view of each slot's leading channels"),
    (lambda a: a.update(v_cache=a["v_cache"][..., ::2]), "a view of each slot's leading channels"),
    (lambda a: a.update(backend="x86-avx512vnni"), "cannot run here"),
])
def test_bad_input_is_refused(change, message):
    a = _args()
    change(a)
    with pytest.raises((ValueError, RuntimeError), match=message):
        ops.decode_attention(**a)


NO_ATTENTION = [name for name, why, layout, *_ in _C.kernel_backends() if layout and name not in BACKENDS]


@pytest.mark.skipif(not NO_ATTENTION, reason="every kernel backend here has decode attention")
def test_backend_without_attention_is_refused():
    with pytest.raises(ValueError, match="has no decode attention"):
        ops.decode_attention(**_args(), backend=NO_ATTENTION[0])
