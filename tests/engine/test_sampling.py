"""Sampler: greedy, seeded reproducibility, top-k/top-p, the empirical distribution, mixed batches."""
from __future__ import annotations

import pytest
import torch

from cpumoe.engine.api import SamplingParams
from cpumoe.engine.sampling import Sampler, make_generator


def sample(logits, params, generators=None):
    return Sampler().sample(logits, params, generators or [make_generator(p) for p in params])


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = torch.randn(5, 17, generator=torch.Generator().manual_seed(0))
    logits[3, 4] = logits[3, 11] = logits[3].max() + 1.0        # a tie: the lower id wins
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert out.dtype == torch.long and out.shape == (5,)
    assert out.tolist() == logits.argmax(dim=-1).tolist()
    assert out[3].item() == 4


def test_make_generator():
    assert make_generator(SamplingParams()) is None
    a, b = make_generator(SamplingParams(seed=7)), make_generator(SamplingParams(seed=7))
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def draws(logits, params, n):
    """n tokens drawn one step at a time from the same logits [V] with the request's generator."""
    sampler, generator = Sampler(), make_generator(params)
    return [sampler.sample(logits.unsqueeze(0), [params], [generator]).item() for _ in range(n)]


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = torch.zeros(1000)                                  # uniform: draws differ as much as they can
    a = draws(logits, SamplingParams(temperature=1.0, seed=1), 20)
    b = draws(logits, SamplingParams(temperature=1.0, seed=1), 20)
    c = draws(logits, SamplingParams(temperature=1.0, seed=2), 20)
    assert a == b
    assert a != c


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_top_k_1_is_greedy(temperature):
    logits = torch.randn(7, 129, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=temperature, top_k=1, seed=i) for i in range(7)]
    assert sample(logits, params).tolist() == logits.argmax(dim=-1).tolist()


def test_small_top_p_keeps_only_the_top_token():
    logits = torch.randn(5, 39, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.5, top_p=1e-6, seed=i) for i in range(5)]
    for _ in range(10):
        assert sample(logits, params).tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45])
def test_top_p_below_float32_keeps_the_top_token(top_p):
    """A top_p that rounds to 0 in float32 must still keep the most likely token: it once removed every token, the
    softmax gave NaN and the whole batch's step failed."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=i) for i in range(2)] + [SamplingParams(temperature=1.0)]
    assert sample(logits, params)[:2].tolist() == logits[:2].argmax(dim=-1).tolist()


def chi_square(counts: list[int], probs: torch.Tensor) -> float:
    n = sum(counts)
    expected = probs * n
    return sum(((c - e) ** 2 / e).item() for c, e in zip(counts, expected) if e > 0)


N_DRAWS = 10000
CHI2_BOUND = 20.0   # 3 degrees of freedom: P(chi2 > 16.3) = 0.001; the seed is fixed, so this is deterministic


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    tokens = draws(logits, SamplingParams(temperature=temperature, seed=123), N_DRAWS)
    counts = [tokens.count(t) for t in range(4)]
    expected = (logits / temperature).softmax(dim=-1)
    assert chi_square(counts, expected) < CHI2_BOUND, (counts, expected * N_DRAWS)


def test_distribution_default_rng_batched():
    """Rows without a generator draw together on torch's default RNG."""
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0]).expand(N_DRAWS, 4).contiguous()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = Sampler().sample(logits, [SamplingParams(temperature=1.0)] * N_DRAWS, [None] * N_DRAWS)
    counts = torch.bincount(out, minlength=4).tolist()
    assert chi_square(counts, logits[0].softmax(dim=-1)) < CHI2_BOUND


@pytest.mark.parametrize("filter_params, kept", [
    (dict(top_k=2), [0, 1]),
    (dict(top_p=0.75), [0, 1]),              # 0.50 + 0.30 reaches 0.75: token 2 is outside the nucleus
    (dict(top_p=0.9), [0, 1, 2]),
    (dict(top_k=3, top_p=0.6), [0, 1]),      # renormalized after top-k: 0.53 < 0.6 <= 0.53 + 0.32
    (dict(top_k=3, top_p=0.5), [0]),         # ... and 0.53 alone reaches 0.5
], ids=["top_k=2", "top_p=0.75", "top_p=0.9", "top_k=3,top_p=0.6", "top_k=3,top_p=0.5"])
def test_filtered_distribution(filter_params, kept):
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])             # token order differs from probability order
    order = [1, 2, 3, 0]                                      # ids by decreasing probability
    kept_ids = [order[i] for i in kept]
    logits = probs.log()
    tokens = draws(logits, SamplingParams(temperature=1.0, seed=5, **filter_params), 4000)
    assert set(tokens) == set(kept_ids)
    expected = torch.zeros(4)
    expected[kept_ids] = probs[kept_ids] / probs[kept_ids].sum()
    counts = [tokens.count(t) for t in range(4)]
    assert chi_square(counts, expected) < CHI2_BOUND, (counts, expected * 4000)


def test_mixed_batch():
    V = 129
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.2, top_p=0.9, top_k=50, seed=12),
        SamplingParams(temperature=1.0),                       # default RNG
    ]
    out = sample(logits, params)
    argmax = logits.argmax(dim=-1)
    assert out[0] == argmax[0] and out[2] == argmax[2]
    assert 0 <= out[4] < V
    # A seeded row draws the same token alone as in the batch.
    for i in (1, 3):
        assert sample(logits[i:i + 1], [params[i]]).item() == out[i].item(), f"row {i}"


def test_bad_batch_shapes():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 5), [SamplingParams()], [None])
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(5), [SamplingParams()], [None])


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_a_row_without_a_distribution_fails_alone():
    """NaN logits (greedy or sampled) and a sampled row at all -inf get FAILED; the other rows draw as they would
    in a batch of their own."""
    from cpumoe.engine.sampling import FAILED
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(4))
    logits[0] = float("-inf")
    logits[1, 5] = float("nan")
    logits[2, 7] = float("nan")
    params = [SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=1.0, top_p=0.9, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)]
    out = sample(logits, params)
    assert out[:3].tolist() == [FAILED] * 3
    assert out[3].item() == sample(logits[3:], params[3:])[0].item()
    assert sample(logits[2:3], params[2:3]).tolist() == [FAILED]  # the all-greedy batch too


@pytest.mark.parametrize("vocab", [7, 32768, 151936])
def test_greedy_batch_fails_exactly_its_nan_rows(vocab):
    """The all-greedy path tells a NaN row by its argmax alone: wherever the NaN sits (first, after the largest
    value, last), beside +inf, at real vocabulary sizes (torch's vectorized reductions)."""
    from cpumoe.engine.sampling import FAILED
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5))
    logits[:, vocab // 3] = 50.0
    logits[1, 0] = logits[2, vocab - 1] = logits[3, vocab // 2] = float("nan")
    logits[4, 1] = float("inf")
    logits[5, 1], logits[5, 2] = float("inf"), float("nan")
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert out.tolist() == [vocab // 3, FAILED, FAILED, FAILED, 1, FAILED]


def test_draw_never_picks_a_zero_probability_id():
    """Inverse CDF at its edges: u = 0 must not land on leading zeros, u x sum rounding up to the sum must land on
    the last id with any probability (not past it, not on trailing zeros)."""
    from cpumoe.engine.sampling import draw
    probs = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.7, 0.0, 0.0]])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        ids = draw(probs.expand(20000, 7).contiguous())
    assert set(ids.tolist()) == {2, 4}
    assert abs((ids == 4).float().mean().item() - 0.7) < 0.02
    # u's extremes, forced: 0 gives the first id with probability, just under 1 the last
    import unittest.mock as mock
    for u, want in ((0.0, 2), (1.0 - 2 ** -24, 4), (1.0, 4)):
        with mock.patch("torch.rand", lambda *a, **k: torch.full((a[0], a[1]), u)):
            assert draw(probs)[0].item() == want, u
