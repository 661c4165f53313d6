"""Load-imbalance and expert-reach figures of routing counts: pure functions of tensors, no model.

Per MoE layer, from c [E] = tokens that chose each expert (sum = T x k):
    max_over_mean   max(c) / mean(c)                           1 = perfectly even; E / k = one expert takes all
    cv              std(c) / mean(c) (population std)          0 = even
    entropy         -sum p log2 p, p = c / sum(c) (bits)       log2(E) = even
    entropy_norm    entropy / log2(E)                          1 = even
    never_chosen    experts with c = 0
Distinct experts a batch of B tokens touches (what a batched decode step reads):
    measured        random batches of B of the traced tokens (tokens of a decode batch come from different
                    requests, so batches are drawn at random, not as B consecutive tokens of one prompt): the mean
                    size of the union of their top-k sets, averaged over the layers
    uniform         E x (1 - (1 - k/E)^B): the same expectation if every token picked k experts uniformly at random
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_BATCHES = 256  # random batches drawn per (layer, B): enough for a mean to 1%


@dataclass(frozen=True, slots=True)
class Imbalance:
    max_over_mean: list[float]
    cv: list[float]
    entropy: list[float]
    entropy_norm: list[float]
    never_chosen: list[int]


def imbalance(counts: torch.Tensor) -> Imbalance:
    """counts [L, E] -> per-layer figures (see the module doc). A layer with no tokens gives NaN ratios."""
    c = counts.double()  # [L, E]
    E = c.shape[1]
    mean = c.mean(dim=1)  # [L]
    p = c / c.sum(dim=1, keepdim=True)  # [L, E]
    entropy = -(p * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum(dim=1)  # [L]
    return Imbalance(
        max_over_mean=(c.max(dim=1).values / mean).tolist(),
        cv=(c.std(dim=1, unbiased=False) / mean).tolist(),
        entropy=entropy.tolist(),
        entropy_norm=(entropy / math.log2(E)).tolist() if E > 1 else [1.0] * c.shape[0],
        never_chosen=(counts == 0).sum(dim=1).tolist(),
    )


def distinct_uniform(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts of `batch` tokens that each pick top_k of num_experts uniformly at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def distinct_measured(topk_ids: torch.Tensor, num_experts: int, batch: int, seed: int = 0) -> float | None:
    """topk_ids [T, k] of one layer -> mean distinct experts over up to MAX_BATCHES random batches of `batch`
    tokens (disjoint within each pass over a permutation); None when fewer than `batch` tokens were traced."""
    T = topk_ids.shape[0]
    if T < batch:
        return None
    chosen = torch.zeros(T, num_experts, dtype=torch.bool)  # [T, E]
    chosen.scatter_(1, topk_ids.long(), True)
    g = torch.Generator().manual_seed(seed)
    sizes = []
    while len(sizes) < MAX_BATCHES:
        n = T // batch
        perm = torch.randperm(T, generator=g)[:n * batch].view(n, batch)  # [n, B]
        sizes += chosen[perm].any(dim=1).sum(dim=1).tolist()  # [n] distinct per batch
    sizes = sizes[:MAX_BATCHES]
    return sum(sizes) / len(sizes)


def distinct_by_batch(per_layer_ids: list[torch.Tensor], num_experts: int, top_k: int,
                      batches: list[int]) -> tuple[list[int], list[float], list[float]]:
    """For each B with enough traced tokens: (B, measured mean over layers, uniform expectation)."""
    kept, measured, uniform = [], [], []
    for B in batches:
        per_layer = [distinct_measured(ids, num_experts, B, seed=i) for i, ids in enumerate(per_layer_ids)]
        if any(v is None for v in per_layer):
            continue
        kept.append(B)
        measured.append(sum(per_layer) / len(per_layer))
        uniform.append(distinct_uniform(num_experts, top_k, B))
    return kept, measured, uniform
