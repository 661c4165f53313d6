"""Write a pruned copy of a per-expert float checkpoint: inter-expert (drop experts and their router rows) or
intra-expert (shrink every routed expert's intermediate size).

    Checkpoint(src) -> refuse what cannot be pruned (architecture, quantized weights, fused experts, ratio, top-k)
      -> plan: per MoE layer, the experts kept (inter, from routing counts) / the channels to drop (intra)
      -> every tensor, in the source's order, copied / sliced / renamed -> shards of <= max_shard_bytes + index
      -> config.json (expert count or intermediate size updated), tokenizer and generation files copied,
         pruning.json (what was dropped, for the record)

One source tensor (and its pruned copy) at a time in memory, plus the shard being filled. Inter-expert pruning
renumbers the kept experts 0.. in their old order; routing over the kept experts is unchanged for
architectures that renormalize the top-k weights (Qwen3-MoE, Mixtral, DeepSeek-V3); where they are not
renormalized (OLMoE, Qwen2-MoE, DeepSeek-V2) the dropped experts' softmax share goes to the kept ones, so even a
token routed only to kept experts gets slightly larger weights.
"""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cpumoe.loader import Checkpoint
from cpumoe.loader.checkpoint import CONFIG, INDEX, SINGLE
from cpumoe.loader.shards import shard_names, split_into_shards
from cpumoe.prune.arch import EXPERT_COUNT_FIELDS, PruneArch, prune_arch
from cpumoe.prune.select import channel_scores, drop_count, kept_channels, least_used

METHODS = ("inter", "intra")
MAX_SHARD_BYTES = 2 * 1024**3
RECORD = "pruning.json"
CHANNEL_CRITERION = "||gate row||_2 x ||up row||_2 x ||down column||_2, lowest dropped"


@dataclass(slots=True)
class PruneResult:
    out: Path
    method: str
    ratio: float
    experts: tuple[int, int]                       # (before, after) per MoE layer
    inter_size: tuple[int, int]                    # (before, after)
    dropped_experts: dict[int, list[int]] = field(default_factory=dict)   # decoder layer -> old ids (inter)
    expert_params: int = 0                         # routed expert parameters written


@dataclass(frozen=True, slots=True)
class _Layout:
    """The source checkpoint's MoE layers: decoder layer -> "model.layers.{i}.{moe}", and E, I, k."""
    arch: PruneArch
    prefixes: dict[int, str]
    num_experts: int
    inter_size: int
    top_k: int


def check_prunable(src: str | Path) -> tuple[Checkpoint, _Layout]:
    """The checkpoint and its MoE layout, or a ValueError naming why it cannot be pruned."""
    from cpumoe.loader.quantized import QuantizedCheckpoint

    ckpt = Checkpoint(src)
    arch = prune_arch(ckpt.model_type)
    fmt = QuantizedCheckpoint(ckpt).format
    if fmt is not None or "quantization_config" in ckpt.config:
        what = fmt.value if fmt is not None else ckpt.config["quantization_config"].get("quant_method", "quantized")
        raise ValueError(f"{ckpt.path} is a quantized checkpoint ({what}): pruning rewrites float expert tensors; "
                         "prune the float checkpoint, then quantize the result")
    pattern = re.compile(rf"model\.layers\.(\d+)\.{re.escape(arch.moe)}\.gate\.weight")
    prefixes = {int(m.group(1)): key.removesuffix(".gate.weight") for key in ckpt.keys()
                if (m := pattern.fullmatch(key))}
    if not prefixes:
        raise ValueError(f"{ckpt.path}: no MoE layer found (no model.layers.*.{arch.moe}.gate.weight)")
    fused = [k for k in ckpt.keys() if ".experts.gate_up_proj" in k or ".experts.down_proj" in k]
    if fused:
        raise ValueError(f"{ckpt.path} stores experts fused ({fused[0]}); pruning reads per-expert tensors "
                         "(experts.{e}.*), as published checkpoints and save_pretrained write them")
    first = prefixes[min(prefixes)]
    E = ckpt.shape(f"{first}.gate.weight")[0]
    gate = f"{first}.experts.0.{arch.experts[0]}.weight"
    if gate not in ckpt:
        raise ValueError(f"{ckpt.path}: {gate} not found")
    for key in ckpt.keys():
        if ".experts." in key and not ckpt.dtype(key).is_floating_point:
            raise ValueError(f"{ckpt.path}: {key} is {ckpt.dtype(key)}, not a float weight: quantized experts "
                             "cannot be pruned")
    top_k = ckpt.config_get("num_experts_per_tok")
    return ckpt, _Layout(arch, dict(sorted(prefixes.items())), E, ckpt.shape(gate)[0], top_k)


def prune_checkpoint(src: str | Path, out: str | Path, *, method: str, ratio: float,
                     counts: dict[int, torch.Tensor] | None = None,
                     max_shard_bytes: int = MAX_SHARD_BYTES) -> PruneResult:
    """Write the pruned checkpoint to `out` (a new or empty directory). inter needs `counts`: decoder layer -> [E]
    tokens that chose each expert on a calibration set (cpumoe.prune.calibration)."""
    if method not in METHODS:
        raise ValueError(f"unknown pruning method {method!r}; choose inter or intra")
    ckpt, layout = check_prunable(src)
    out = Path(out)
    if out.resolve() == ckpt.path.resolve():
        raise ValueError("the output directory is the source checkpoint: write the pruned one elsewhere")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory")
    config = dict(ckpt.config)
    E, I = layout.num_experts, layout.inter_size
    result = PruneResult(out=out, method=method, ratio=ratio, experts=(E, E), inter_size=(I, I))
    if method == "inter":
        kept = _plan_inter(ckpt, layout, ratio, counts, result)
        rename = _inter_tensors(ckpt, layout, kept)
        for name in EXPERT_COUNT_FIELDS:
            if name in config:
                config[name] = result.experts[1]
    else:
        drop = drop_count(ratio, I, "intermediate channels")
        result.inter_size = (I, I - drop)
        rename = _intra_tensors(ckpt, layout, drop)
        config[layout.arch.inter_field] = I - drop
    out.mkdir(parents=True, exist_ok=True)
    result.expert_params = _write(ckpt, rename, out, max_shard_bytes)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    for f in sorted(ckpt.path.iterdir()):
        if f.is_file() and f.name not in (CONFIG, INDEX, SINGLE, RECORD) and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)  # tokenizer, generation config, chat template, licence
    record = {"source": str(ckpt.path.resolve()), "method": method, "ratio": ratio, "experts": list(result.experts),
              "inter_size": list(result.inter_size),
              "dropped_experts": {str(k): v for k, v in result.dropped_experts.items()}}
    if method == "intra":
        record["channel_criterion"] = CHANNEL_CRITERION
    (out / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return result


def _plan_inter(ckpt: Checkpoint, layout: _Layout, ratio: float, counts: dict[int, torch.Tensor] | None,
                result: PruneResult) -> dict[int, list[int]]:
    """decoder layer -> the old ids of the experts kept, ascending."""
    E = layout.num_experts
    groups = _routing_groups(ckpt, layout)
    drop = drop_count(ratio, E // groups, "experts per group" if groups > 1 else "experts") * groups
    new_E = E - drop
    if layout.top_k > new_E:
        raise ValueError(f"num_experts_per_tok {layout.top_k} would exceed the {new_E} experts left after dropping "
                         f"{drop} of {E}: use a smaller ratio")
    if groups > 1:
        topk_group = ckpt.config_get("topk_group", default=groups) or groups
        if layout.top_k > topk_group * (new_E // groups):
            raise ValueError(f"num_experts_per_tok {layout.top_k} exceeds the {topk_group * (new_E // groups)} "
                             f"experts of the {topk_group} groups routing keeps, after pruning")
        if "gate.e_score_correction_bias" in layout.arch.router and new_E // groups < 2:
            raise ValueError(f"{new_E // groups} expert per group left: DeepSeek-V3's grouped routing scores a group "
                             "by its best two experts")
    if counts is None:
        raise ValueError("inter-expert pruning needs routing counts from a calibration set")
    kept = {}
    for layer in layout.prefixes:
        if layer not in counts:
            raise ValueError(f"no routing counts for MoE layer {layer}")
        c = torch.as_tensor(counts[layer])
        if c.shape != (E,):
            raise ValueError(f"routing counts of layer {layer} have shape {list(c.shape)}, expected [{E}]")
        dropped = least_used(c, drop, groups)
        result.dropped_experts[layer] = dropped
        kept[layer] = sorted(set(range(E)) - set(dropped))
    result.experts = (E, new_E)
    return kept


def _routing_groups(ckpt: Checkpoint, layout: _Layout) -> int:
    """The expert groups routing picks among (DeepSeek-V2's group_limited_greedy, DeepSeek-V3's noaux_tc); 1 when
    every expert is selectable on its own."""
    if not layout.arch.grouped:
        return 1
    if ckpt.model_type == "deepseek_v2":
        if ckpt.config_get("topk_method", default="greedy") != "group_limited_greedy":
            return 1
        return ckpt.config_get("n_group", default=1) or 1
    return ckpt.config_get("n_group", default=8) or 1  # DeepseekV3Config's default


# Every output tensor's name -> the function that produces it (None: the source tensor of that name, as it is).
Plan = dict[str, Callable[[], torch.Tensor] | None]


def _inter_tensors(ckpt: Checkpoint, layout: _Layout, kept: dict[int, list[int]]) -> Plan:
    plan: Plan = {}
    experts = {prefix: re.compile(rf"{re.escape(prefix)}\.experts\.(\d+)\.(.+)") for prefix in layout.prefixes.values()}
    routers = {f"{prefix}.{r}": layer for layer, prefix in layout.prefixes.items() for r in layout.arch.router}
    moved: dict[str, dict[int, int]] = {prefix: {old: new for new, old in enumerate(kept[layer])}
                                        for layer, prefix in layout.prefixes.items()}
    for key in ckpt.keys():
        layer_prefix = next((p for p in layout.prefixes.values() if key.startswith(p + ".experts.")), None)
        if key in routers:
            ids = torch.tensor(kept[routers[key]])
            plan[key] = lambda key=key, ids=ids: ckpt.read(key).index_select(0, ids).contiguous()  # [E', ...]
        elif layer_prefix is not None:
            m = experts[layer_prefix].fullmatch(key)
            if m is None:
                raise ValueError(f"{ckpt.path}: unexpected tensor {key} among the experts")
            new = moved[layer_prefix].get(int(m.group(1)))
            if new is not None:
                plan[f"{layer_prefix}.experts.{new}.{m.group(2)}"] = lambda key=key: ckpt.read(key)
        elif any(key.startswith(p + ".gate.") for p in layout.prefixes.values()):
            raise ValueError(f"{ckpt.path}: router tensor {key} is not one pruning knows how to cut")
        else:
            plan[key] = None
    return plan


def _intra_tensors(ckpt: Checkpoint, layout: _Layout, drop: int) -> Plan:
    gate, up, down = layout.arch.experts
    plan: Plan = {}
    cache: dict[str, torch.Tensor] = {}

    def keep(base: str) -> torch.Tensor:
        """The channels expert `base` ("...experts.{e}" or "...shared_experts") keeps (long, ascending)."""
        if base not in cache:
            cache.clear()  # experts are visited one after another: one set of ids at a time
            w = [ckpt.read(f"{base}.{p}.weight") for p in (gate, up, down)]
            cache[base] = kept_channels(channel_scores(*w), drop * _multiple(ckpt, layout, base))
        return cache[base]

    shared = layout.arch.shared_from_inter
    prefixes = "|".join(re.escape(p) for p in layout.prefixes.values())
    owners = rf"experts\.\d+|{re.escape(shared)}" if shared else r"experts\.\d+"
    projection = re.compile(rf"((?:{prefixes})\.(?:{owners}))\.({gate}|{up}|{down})\.weight")
    for key in ckpt.keys():
        m = projection.fullmatch(key)
        if m is None:
            plan[key] = None
            continue
        base, proj = m.group(1), m.group(2)
        dim = 1 if proj == down else 0  # gate, up [I, H]: rows; down [H, I]: columns
        plan[key] = lambda key=key, base=base, dim=dim: ckpt.read(key).index_select(dim, keep(base)).contiguous()
    return plan


def _multiple(ckpt: Checkpoint, layout: _Layout, base: str) -> int:
    """A shared MLP of n_shared_experts x I drops n_shared x the channels of one routed expert."""
    if ".experts." in base:
        return 1
    return ckpt.shape(f"{base}.{layout.arch.experts[0]}.weight")[0] // layout.inter_size


def _write(ckpt: Checkpoint, plan: Plan, out: Path, max_shard_bytes: int) -> int:
    """Produce every planned tensor into shards of <= max_shard_bytes, write the index; returns the routed expert
    parameters written."""
    from safetensors.torch import save_file

    shards = split_into_shards(list(plan), lambda name: _planned_bytes(ckpt, name), max_shard_bytes)
    files = shard_names(len(shards), single_file=False)
    weight_map, total, expert_params = {}, 0, 0
    for names, file in zip(shards, files):
        tensors = {}
        for name in names:
            make = plan[name]
            t = ckpt.read(name) if make is None else make()
            tensors[name] = t.contiguous()
            total += t.nbytes
            if ".experts." in name:
                expert_params += t.numel()
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return expert_params


def _planned_bytes(ckpt: Checkpoint, name: str) -> int:
    """A tensor's size before it is produced: its source's (an upper bound for a sliced one; a renamed expert
    has the size of the one whose name it takes)."""
    n = 1
    for d in ckpt.shape(name):
        n *= d
    return n * ckpt.dtype(name).itemsize
