"""Which experts and which channels pruning drops: pure functions of counts and weights.

Inter-expert: the `n` experts of a layer that the calibration tokens chose least often; equal counts drop the
lower expert id first (a stable ascending sort). With grouped routing (DeepSeek's n_group) the same number is
dropped from every group, so the groups stay equal and the router's group scores keep their meaning.
Intra-expert: per expert, the channels c of the intermediate size with the smallest
    score(c) = ||gate[c, :]||_2 x ||up[c, :]||_2 x ||down[:, c]||_2
(the channel's output is down[:, c] x silu(gate[c] . x) x (up[c] . x): the product bounds its size for a unit
input); equal scores drop the lower channel first. Kept ids are returned ascending, so the survivors keep their
order (experts are renumbered 0.. in that order).
"""
from __future__ import annotations

import torch


def drop_count(ratio: float, n: int, what: str) -> int:
    """floor(ratio x n), which must leave at least one of the n and drop at least one."""
    if not 0 < ratio < 1:
        raise ValueError(f"ratio must be in (0, 1), got {ratio}")
    drop = int(ratio * n + 1e-9)
    if drop < 1:
        raise ValueError(f"ratio {ratio} of {n} {what} drops none (floor({ratio} x {n}) = 0)")
    return drop


def least_used(counts: torch.Tensor, drop: int, groups: int = 1) -> list[int]:
    """counts [E] -> the `drop` expert ids to remove (drop / groups of each of `groups` equal groups), ascending."""
    E = counts.shape[0]
    if E % groups or drop % groups:
        raise ValueError(f"{drop} of {E} experts cannot be dropped evenly from {groups} groups")
    size, per_group = E // groups, drop // groups
    dropped = []
    for g in range(groups):
        order = torch.sort(counts[g * size:(g + 1) * size], stable=True).indices  # ascending, ties by id
        dropped += (order[:per_group] + g * size).tolist()
    return sorted(dropped)


def channel_scores(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """gate, up [I, H], down [H, I] -> score [I] float32 (see the module doc)."""
    return (gate.float().norm(dim=1) * up.float().norm(dim=1) * down.float().norm(dim=0))  # [I]


def kept_channels(scores: torch.Tensor, drop: int) -> torch.Tensor:
    """scores [I] -> the ids of the I - drop channels to keep, ascending (long)."""
    order = torch.sort(scores, stable=True).indices  # ascending, ties by id
    return order[drop:].sort().values
