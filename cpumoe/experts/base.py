"""What an experts backend is: it declares what it supports, packs weights once, and runs the layer.

    router -> select_experts -> ExpertsBackend.apply(prepared weights, x, topk_weights, topk_ids) -> [M, H]
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cpumoe.quant import QuantizedWeight, stack
from cpumoe.reference import ACTIVATIONS


# read_expert(e) -> (w13_e [2I, H] gate rows then up rows, w2_e [H, I]); for quantized layers, QuantizedWeights
ExpertReader = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
QuantExpertReader = Callable[[int], tuple[QuantizedWeight, QuantizedWeight]]
# (hidden_states [M, H], router_logits [M, E]) -> out [M, H], or None for tensors the call was not made for
RoutedCall = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]


@dataclass(frozen=True, slots=True)
class ExpertsConfig:
    """Everything a backend needs to know to say whether it can run a layer."""
    hidden_size: int
    inter_size: int
    num_experts: int                      # experts held locally (rows of w13/w2)
    top_k: int
    dtype: torch.dtype                    # of the activations (and of unquantized weights)
    activation: str = "silu"
    has_bias: bool = False
    expert_parallel: bool = False         # an expert_map drops experts not on this shard
    apply_router_weight_on_input: bool = False
    quantization: str = "none"            # or a cpumoe.quant.QuantFormat value: "int8_w8a8", "int4_w4a16", ...
    group_size: int = 0                   # quantized: the format's group (0: a whole row)


@dataclass(slots=True)
class PreparedExperts:
    """Weights in the layout the backend wants, made once after loading."""
    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2, self.w13_bias, self.w2_bias)
                   if t is not None)


class ExpertsBackend:
    """One way to run the experts. Subclasses set `name` and implement the three methods."""
    name: str = "?"
    # A row's result never depends on how many rows share its call (what batch-invariant engines need).
    rows_independent: bool = True

    def is_supported(self, config: ExpertsConfig) -> tuple[bool, str]:
        """(True, "") when this backend can run `config` on this machine, else (False, why not)."""
        raise NotImplementedError

    def prepare(self, w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None,
                w2_bias: torch.Tensor | None) -> PreparedExperts:
        raise NotImplementedError

    def prepare_experts(self, num_experts: int, read_expert: ExpertReader, w13_bias: torch.Tensor | None,
                        w2_bias: torch.Tensor | None) -> PreparedExperts:
        """As prepare, from read_expert(e) -> (w13_e [2I, H], w2_e [H, I]). This default stacks them first;
        backends with their own layout pack expert by expert, so a layer's unpacked weights never all exist."""
        pairs = [read_expert(e) for e in range(num_experts)]
        w13 = torch.stack([p[0] for p in pairs])
        w2 = torch.stack([p[1] for p in pairs])
        del pairs
        return self.prepare(w13, w2, w13_bias, w2_bias)

    def prepare_quantized(self, config: ExpertsConfig, w13: QuantizedWeight, w2: QuantizedWeight,
                          w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None) -> PreparedExperts:
        """As prepare, from quantized stacks w13 [E, 2I, H] and w2 [E, H, I] (config.quantization is their format)."""
        raise NotImplementedError

    def prepare_quantized_experts(self, config: ExpertsConfig, num_experts: int, read_expert: QuantExpertReader,
                                  w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None) -> PreparedExperts:
        """As prepare_quantized, one expert at a time. This default stacks them first."""
        pairs = [read_expert(e) for e in range(num_experts)]
        return self.prepare_quantized(config, stack([p[0] for p in pairs]), stack([p[1] for p in pairs]), w13_bias,
                                      w2_bias)

    def apply(self, prepared: PreparedExperts, config: ExpertsConfig, hidden_states: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def bind_routed(self, prepared: PreparedExperts, config: ExpertsConfig, num_experts: int, routing: dict,
                    expert_map: torch.Tensor | None) -> RoutedCall | None:
        """select_experts(router_logits, config.top_k, **routing) then apply, bound once as one native call
        (hidden_states, router_logits) -> out, or None from the call when it was not made for those tensors; None
        where this backend has no such call or the routing is one select_experts runs in torch ops."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def check_common(config: ExpertsConfig) -> tuple[bool, str]:
    """Checks every backend shares."""
    if config.activation not in ACTIVATIONS:
        return False, f"no activation {config.activation!r}"
    if config.apply_router_weight_on_input and config.top_k != 1:
        return False, "apply_router_weight_on_input needs top_k == 1"
    return True, ""
