"""Record the experts each MoE layer's tokens choose during a forward, for activation counts and calibration.

    with RoutingTrace(model) as trace:      # forward hooks on every MoE block's FusedMoE
        model(ids)                          # each layer's routing is redone on its router logits and kept
    trace.counts()                          # [L, E] tokens per MoE layer and expert
    trace.topk_ids(i)                       # [T, k] int32: every token's experts in MoE layer i, in forward order

The hooks exist only inside the `with`: a model outside one runs exactly as before, at no cost. They recompute
select_experts on the same logits with the layer's own routing arguments, so the ids are those the layer used.
Models whose MoE blocks route outside FusedMoE.forward (calling `experts.experts(...)` themselves) are not seen:
`layers` is then empty and RoutingTrace refuses the model.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from cpumoe.layer import FusedMoE
from cpumoe.routing import select_experts

_LAYER = re.compile(r"layers\.(\d+)\.")


class RoutingTrace:
    """Routing decisions of every MoE layer of `model` while inside `with`. `layers`: the decoder layer index of
    each MoE layer, in order; `num_experts`: E (every MoE layer of a model has the same)."""

    def __init__(self, model: nn.Module):
        found = []
        for name, module in model.named_modules():
            if isinstance(module, FusedMoE):
                m = _LAYER.search(name)
                found.append((int(m.group(1)) if m else len(found), module))
        if not found:
            raise ValueError("the model has no FusedMoE layers whose routing can be traced")
        found.sort(key=lambda item: item[0])
        self.layers = [index for index, _ in found]
        self._modules = [module for _, module in found]
        self.num_experts = self._modules[0].num_experts
        self.top_k = self._modules[0].top_k
        self._ids: list[list[torch.Tensor]] = [[] for _ in found]
        self._hooks: list = []

    def __enter__(self) -> RoutingTrace:
        self._hooks = [module.register_forward_hook(self._hook(i)) for i, module in enumerate(self._modules)]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _hook(self, index: int):
        def record(layer: FusedMoE, args, output) -> None:
            if len(args) == 2:  # (hidden_states [M, H], router_logits [M, E])
                _, topk_ids = select_experts(args[1], layer.top_k, **layer.routing)  # [M, k]
                self._ids[index].append(topk_ids.clone())
        return record

    @property
    def tokens(self) -> int:
        """Tokens routed through the first MoE layer so far."""
        return sum(ids.shape[0] for ids in self._ids[0])

    def topk_ids(self, index: int) -> torch.Tensor:
        """[T, k] int32: the experts of every token routed through MoE layer `index` (position in `layers`)."""
        chunks = self._ids[index]
        return torch.cat(chunks) if chunks else torch.empty(0, self.top_k, dtype=torch.int32)

    def counts(self) -> torch.Tensor:
        """[L, E] int64: how many tokens chose each expert, per MoE layer."""
        return torch.stack([torch.bincount(self.topk_ids(i).flatten().long(), minlength=self.num_experts)
                            for i in range(len(self.layers))])
