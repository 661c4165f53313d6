"""ops.greedy_tokens (csrc/core/greedy.h) against its reference, torch.argmax with a NaN check: the first of equal
maxima, NO_TOKEN for a row that holds a NaN; over vocabularies that fill and do not fill its 16 lanes, one row and rows
split over the pool, ties, infinities, and bad input."""
import pytest
import torch

from cpumoe import ops


def reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1).masked_fill(torch.isnan(logits).any(dim=-1), ops.NO_TOKEN)


@pytest.mark.parametrize("rows, vocab", [(1, 1), (1, 15), (1, 16), (1, 17), (3, 100), (1, 32768), (1, 151_939),
                                         (16, 32771), (40, 9000)])
def test_matches_reference(rows, vocab):
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = torch.randn(rows, vocab, generator=g) * 5
    assert torch.equal(ops.greedy_tokens(logits), reference(logits))


@pytest.mark.parametrize("vocab", [17, 64, 1000])
def test_ties_take_the_first(vocab):
    logits = torch.zeros(4, vocab)
    logits[0, [3, vocab - 1]] = 2.0                 # two maxima: the first
    logits[1, [vocab - 1, vocab - 2]] = 1.0         # in the tail past the lanes, and in a lane
    logits[2] = float("-inf")                       # every token -inf: the first, as argmax
    logits[3, [5, 16]] = float("inf")               # +inf twice, in two lanes
    out = ops.greedy_tokens(logits)
    assert torch.equal(out, reference(logits)), out
    assert out.tolist() == [3, vocab - 2, 0, 5]


def test_the_maximum_at_every_position_of_the_blocks_and_the_tail():
    logits = torch.full((50, 50), -3.0)
    logits[torch.arange(50), torch.arange(50)] = 1.0   # row i: its maximum at i (blocks of 16, then a tail of 2)
    logits[:, 49] = 0.5
    assert ops.greedy_tokens(logits).tolist() == list(range(50))


def test_signed_zeros_tie_as_argmax_ties_them():
    logits = torch.tensor([[-1.0] * 20 + [-0.0, 0.0], [-1.0] * 3 + [0.0] + [-1.0] * 16 + [-0.0, -1.0]])
    assert torch.equal(ops.greedy_tokens(logits), reference(logits))
    assert ops.greedy_tokens(logits).tolist() == [20, 3]


def test_a_row_with_a_nan_has_no_token_and_the_others_keep_theirs():
    logits = torch.randn(20, 40_000)
    logits[3, 0] = float("nan")
    logits[7, 39_999] = float("nan")  # in the tail
    logits[11, 16 * 100 + 5] = float("nan")
    out = ops.greedy_tokens(logits)
    assert torch.equal(out, reference(logits))
    assert [i for i, t in enumerate(out.tolist()) if t == ops.NO_TOKEN] == [3, 7, 11]


@pytest.mark.parametrize("logits, message", [
    (torch.randn(2, 8).bfloat16(), "float32"),
    (torch.randn(8), "2-D"),
    (torch.randn(8, 2).t(), "contiguous"),
])
def test_bad_input_is_refused(logits, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        ops.greedy_tokens(logits)


def test_fake_kernel():
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        out = torch.ops.cpumoe.greedy_tokens(mode.from_tensor(torch.randn(3, 50)))
    assert out.shape == (3,) and out.dtype == torch.long
