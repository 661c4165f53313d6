"""Perplexity, top-1 agreement and KL divergence against values computed by hand."""
import math

import pytest
import torch

from cpumoe.prune.quality import kl_divergence, perplexity, top1_agreement


def test_perplexity_by_hand():
    # uniform over 4: perplexity 4 whatever the target
    assert perplexity(torch.zeros(3, 4), torch.tensor([0, 1, 3])) == pytest.approx(4.0)
    # p(target) = 1/2 and 1/4: exp(mean(log 2, log 4)) = sqrt(8)
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]]))
    assert perplexity(logits, torch.tensor([0, 2])) == pytest.approx(math.sqrt(8.0))


def test_top1_agreement_by_hand():
    ref = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    other = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0], [0.0, 0.0, 1.0], [0.0, 3.0, 0.0]])
    assert top1_agreement(ref, other) == pytest.approx(0.5)
    assert top1_agreement(ref, ref) == 1.0


def test_kl_by_hand():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
    q = torch.tensor([[0.25, 0.75], [0.9, 0.1]])
    expected = (0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75) + 0.0) / 2
    assert kl_divergence(p.log(), q.log()) == pytest.approx(expected)
    assert kl_divergence(q.log(), q.log()) == pytest.approx(0.0, abs=1e-12)
    # logits, not probabilities: shifting a row changes nothing; a -inf reference logit (p = 0) adds nothing
    assert kl_divergence(p.log() + 7.0, q.log() - 3.0) == pytest.approx(expected)
    ref = torch.tensor([[0.0, float("-inf")]])
    assert kl_divergence(ref, torch.tensor([[0.0, 0.0]])) == pytest.approx(math.log(2.0))


def test_bad_shapes():
    with pytest.raises(ValueError, match="differ in shape"):
        kl_divergence(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="targets must be"):
        perplexity(torch.zeros(2, 3), torch.tensor([0]))
    with pytest.raises(ValueError, match="N >= 1"):
        top1_agreement(torch.zeros(0, 3), torch.zeros(0, 3))
