"""Load-imbalance and distinct-experts figures on counts and ids whose answers are known by hand."""
import math

import pytest
import torch

from cpumoe.bench.activation.stats import distinct_by_batch, distinct_measured, distinct_uniform, imbalance


def test_imbalance_known_counts():
    counts = torch.tensor([[5, 5, 0, 0, 0, 0, 5, 5],      # 4 of 8 equally: max/mean 2, CV 1, 2 bits of 3
                           [10, 10, 10, 10, 10, 10, 10, 10],  # even
                           [80, 0, 0, 0, 0, 0, 0, 0]])     # all on one expert
    im = imbalance(counts)
    assert im.max_over_mean == pytest.approx([2.0, 1.0, 8.0])
    assert im.cv == pytest.approx([1.0, 0.0, math.sqrt(7.0)])  # one of 8 at 8x the mean: std = sqrt(7) x mean
    assert im.entropy == pytest.approx([2.0, 3.0, 0.0])
    assert im.entropy_norm == pytest.approx([2 / 3, 1.0, 0.0])
    assert im.never_chosen == [4, 0, 7]


def test_distinct_uniform_formula():
    assert distinct_uniform(8, 2, 1) == pytest.approx(2.0)
    assert distinct_uniform(128, 8, 2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert distinct_uniform(4, 2, 64) == pytest.approx(4.0)


def test_distinct_measured_forced_ids():
    same = torch.tensor([[0, 1]] * 40, dtype=torch.int32)  # every token picks {0, 1}: any batch touches 2
    assert [distinct_measured(same, 8, b) for b in (1, 4, 32)] == [2.0, 2.0, 2.0]
    disjoint = torch.tensor([[2 * (t % 4), 2 * (t % 4) + 1] for t in range(40)], dtype=torch.int32)
    assert distinct_measured(disjoint, 8, 1) == 2.0
    assert distinct_measured(disjoint, 8, 40) == 8.0  # all the tokens: every pair
    assert distinct_measured(disjoint, 8, 41) is None  # more than were traced
    kept, measured, uniform = distinct_by_batch([same, disjoint], 8, 2, [1, 40, 64])
    assert kept == [1, 40] and measured == [2.0, 5.0] and uniform[0] == pytest.approx(2.0)
