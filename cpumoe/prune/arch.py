"""What pruning needs to know of each architecture: where its experts and router rows are, and which config
fields give their count and size. Names are those of the published per-expert checkpoints (and of
`save_pretrained`), under `model.layers.{i}.{moe}.`:

    {moe}.gate.weight [E, H]                       router rows, one per expert (+ DeepSeek-V3's
    {moe}.gate.e_score_correction_bias [E]         selection bias)
    {moe}.experts.{e}.{gate,up}.weight [I, H]      expert e's gate and up projections
    {moe}.experts.{e}.{down}.weight [H, I]         its down projection
    {moe}.shared_experts.* (DeepSeek)              shared MLP of moe_intermediate_size x n_shared_experts
"""
from __future__ import annotations

from dataclasses import dataclass

EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")  # each architecture names E so


@dataclass(frozen=True, slots=True)
class PruneArch:
    inter_field: str                       # config field of one routed expert's I
    moe: str = "mlp"                       # the MoE module of a layer
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")   # gate, up, down
    router: tuple[str, ...] = ("gate.weight",)   # per-expert router tensors (expert on dim 0), under {moe}
    shared_from_inter: str | None = None   # a shared MLP sized from inter_field (DeepSeek): shrunk with it
    grouped: bool = False                  # n_group / topk_group routing: experts are pruned group by group


_DEEPSEEK = dict(inter_field="moe_intermediate_size", shared_from_inter="shared_experts", grouped=True)

ARCHS: dict[str, PruneArch] = {
    "qwen3_moe": PruneArch("moe_intermediate_size"),
    "qwen2_moe": PruneArch("moe_intermediate_size"),    # the sigmoid-gated shared_expert keeps its own size
    "olmoe": PruneArch("intermediate_size"),
    "mixtral": PruneArch("intermediate_size", moe="block_sparse_moe", experts=("w1", "w3", "w2")),
    "deepseek_v2": PruneArch(**_DEEPSEEK),
    "deepseek_v3": PruneArch(**_DEEPSEEK, router=("gate.weight", "gate.e_score_correction_bias")),
}

REFUSED: dict[str, str] = {
    "gpt_oss": "gpt-oss stores each layer's experts fused in one tensor with interleaved gate/up rows and biases "
               "(MXFP4 in the published checkpoints); pruning rewrites per-expert float tensors only",
}


def prune_arch(model_type: str) -> PruneArch:
    if model_type in REFUSED:
        raise ValueError(f"model_type {model_type!r} cannot be pruned: {REFUSED[model_type]}")
    if model_type not in ARCHS:
        raise ValueError(f"model_type {model_type!r} cannot be pruned; supported: {', '.join(sorted(ARCHS))}")
    return ARCHS[model_type]
