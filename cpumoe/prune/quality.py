"""How far a pruned model's next-token distributions are from the full model's: pure functions of logits.

    logits [N, V] (float; N positions, each predicting the next token), targets [N] (the tokens that follow)
    perplexity       exp(mean over positions of -log softmax(logits)[target])
    top1_agreement   share of positions where both models' most likely token is the same
    kl_divergence    mean over positions of KL(p_full || p_pruned) = sum_v p_full (log p_full - log p_pruned), nats
All in float64 from log_softmax, so exact zeros and tiny probabilities stay finite.
"""
from __future__ import annotations

import math

import torch


def _check(a: torch.Tensor, b: torch.Tensor | None = None) -> None:
    if a.dim() != 2 or a.shape[0] == 0:
        raise ValueError(f"logits must be [N, V] with N >= 1, got {list(a.shape)}")
    if b is not None and b.shape != a.shape:
        raise ValueError(f"the two models' logits differ in shape: {list(a.shape)} and {list(b.shape)}")


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    _check(logits)
    if targets.shape != (logits.shape[0],):
        raise ValueError(f"targets must be [N={logits.shape[0]}], got {list(targets.shape)}")
    logp = logits.double().log_softmax(dim=-1)  # [N, V]
    nll = -logp.gather(1, targets.long()[:, None]).squeeze(1)  # [N]
    return math.exp(nll.mean().item())


def top1_agreement(reference: torch.Tensor, logits: torch.Tensor) -> float:
    _check(reference, logits)
    return (reference.argmax(dim=-1) == logits.argmax(dim=-1)).double().mean().item()


def kl_divergence(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean KL(p_reference || p_logits) over the positions, in nats."""
    _check(reference, logits)
    logp = reference.double().log_softmax(dim=-1)  # [N, V]
    logq = logits.double().log_softmax(dim=-1)  # [N, V]
    p = logp.exp()
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))  # 0 log 0 = 0 (a -inf logit)
    return terms.sum(dim=-1).mean().item()
