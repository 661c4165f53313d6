"""The MoE layer shapes of real models, named so every benchmark, sweep and synthetic checkpoint runs the same work.
They come from the presets of the architectures (cpumoe.models: each model's public config.json, in one place).

    H = hidden, I = inter (one routed expert's intermediate size), E = experts, k = top_k

Routing is given as select_experts arguments (cpumoe.routing): Mixtral and gpt-oss take the top-k logits and
softmax over those k, which is softmax + top-k + renormalize. Phi-3.5-MoE's "sparsemixer" is not a
select_experts scoring: `router_scoring` says what runs in its place (the same cost: softmax over E, top-2).
"""
from __future__ import annotations

from dataclasses import dataclass

from cpumoe.routing import SCORINGS


@dataclass(frozen=True, slots=True)
class LayerPreset:
    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    shared_experts: int
    activation: str
    scoring: str
    renormalize: bool
    shared_inter: int = 0                  # intermediate size of each shared expert (0: none)
    bias: bool = False                     # w13/w2 carry biases (gpt-oss)
    router_weight_on_input: bool = False   # the routing weight scales the input, not the output (Llama-4)

    @property
    def router_scoring(self) -> str:
        """The select_experts scoring that runs this preset's routing (softmax stands in for sparsemixer)."""
        return self.scoring if self.scoring in SCORINGS else "softmax"


def _all_presets() -> dict[str, LayerPreset]:
    from cpumoe.models import model_presets
    return {name: arch.layer_preset(preset) for name, (arch, preset) in model_presets().items()}


PRESETS: dict[str, LayerPreset] = _all_presets()


def get_preset(name: str) -> LayerPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
