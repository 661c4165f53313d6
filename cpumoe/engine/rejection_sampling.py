"""Verification of drafted tokens (speculative decoding): which drafts the target model keeps, and its own token
after them.

    greedy   -> accept drafts while they equal the target's argmax, then the target's argmax at the first miss (or
                after the last draft): token for token what decoding without drafts gives
    sampled  -> accept draft d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from
                max(0, p_i - q_i) renormalized; all accepted: one more token from p_{k+1}
    p: the target's distribution after temperature, top-k, top-p (sampling.probabilities); q: the draft's, a point
    mass at d_i when the proposer does not sample (n-gram lookup, greedy drafts). The output keeps the target's
    distribution (Leviathan et al. 2023, "Fast inference from transformers via speculative decoding").
"""
from __future__ import annotations

import torch

from cpumoe import ops
from cpumoe.engine.api import SamplingParams
from cpumoe.engine.sampling import FAILED, GREEDY_EPS, draw, probabilities


def verify(logits: torch.Tensor, drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
           params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[list[int]]:
    """logits: float32 [sum(len(d) + 1), V], each sequence's k + 1 rows in order. Returns per sequence the accepted
    drafts followed by one token of the target's (the correction or the bonus); FAILED ends a list whose logits
    give no distribution."""
    out = []
    start = 0
    for d, q, p, g in zip(drafts, draft_probs, params, generators):
        rows = logits[start:start + len(d) + 1].float()                              # [k + 1, V]
        start += len(d) + 1
        out.append(_verify_greedy(rows, d) if p.temperature < GREEDY_EPS else _verify_sampled(rows, d, q, p, g))
    return out


def _verify_greedy(rows: torch.Tensor, drafts: list[int]) -> list[int]:
    target = ops.greedy_tokens(rows.contiguous()).tolist()  # [k + 1]; FAILED for a row with a NaN
    accepted = []
    for d, t in zip(drafts, target):
        if t != d:
            break
        accepted.append(d)
    return accepted + [target[len(accepted)]]


def _verify_sampled(rows: torch.Tensor, drafts: list[int], q: torch.Tensor | None, params: SamplingParams,
                    generator: torch.Generator | None) -> list[int]:
    probs = probabilities(rows, [params] * len(rows))                                # [k + 1, V]
    valid = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
    u = torch.rand(len(drafts), generator=generator).tolist()
    accepted = []
    for i, d in enumerate(drafts):
        if not valid[i]:
            return accepted + [FAILED]
        q_d = 1.0 if q is None else float(q[i, d])
        if u[i] * q_d < float(probs[i, d]):   # u < p / q, without dividing by a q of 0
            accepted.append(d)
            continue
        residual = probs[i].clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = (residual - q[i]).clamp_(min=0.0)
        if not residual.sum() > 0:  # p <= q everywhere up to rounding: p itself is the residual's limit
            residual = probs[i]
        return accepted + [int(draw(residual[None], generator)[0])]
    i = len(drafts)
    if not valid[i]:
        return accepted + [FAILED]
    return accepted + [int(draw(probs[i:i + 1], generator)[0])]
