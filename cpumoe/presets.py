"""The MoE layer shapes of real models (/work/shared/workloads.md), named so every benchmark, sweep and synthetic
checkpoint runs the same work. Facts from each model's public config.json.

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


PRESETS: dict[str, LayerPreset] = {p.name: p for p in (
    LayerPreset("qwen3-30b-a3b", hidden=2048, inter=768, experts=128, top_k=8, shared_experts=0,
                activation="silu", scoring="softmax", renormalize=True),
    LayerPreset("olmoe-1b-7b", hidden=2048, inter=1024, experts=64, top_k=8, shared_experts=0,
                activation="silu", scoring="softmax", renormalize=False),
    LayerPreset("qwen1.5-moe-a2.7b", hidden=2048, inter=1408, experts=60, top_k=4, shared_experts=1,
                activation="silu", scoring="softmax", renormalize=False, shared_inter=5632),
    LayerPreset("deepseek-v2-lite", hidden=2048, inter=1408, experts=64, top_k=6, shared_experts=2,
                activation="silu", scoring="softmax", renormalize=False, shared_inter=1408),
    LayerPreset("mixtral-8x7b", hidden=4096, inter=14336, experts=8, top_k=2, shared_experts=0,
                activation="silu", scoring="softmax", renormalize=True),
    LayerPreset("phi-3.5-moe", hidden=4096, inter=6400, experts=16, top_k=2, shared_experts=0,
                activation="silu", scoring="sparsemixer", renormalize=False),
    LayerPreset("gpt-oss-20b", hidden=2880, inter=2880, experts=32, top_k=4, shared_experts=0,
                activation="swigluoai", scoring="softmax", renormalize=True, bias=True),
    LayerPreset("llama-4-scout-17b-16e", hidden=5120, inter=8192, experts=16, top_k=1, shared_experts=1,
                activation="silu", scoring="sigmoid", renormalize=False, shared_inter=8192,
                router_weight_on_input=True),
)}


def get_preset(name: str) -> LayerPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
