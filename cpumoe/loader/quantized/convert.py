"""`cpumoe quantize`: a float checkpoint directory -> the same model in a public quantized layout.

    plan (headers only: which tensors become which, checked before anything is written)
      -> per tensor: read (file reads, one tensor in memory) -> quantize (cpumoe.quant) -> the layout's tensors
      -> shards of <= max_shard_bytes + model.safetensors.index.json -> config.json + quantization_config
      -> every other file (tokenizer, generation_config.json, ...) copied

What is quantized: every linear `<prefix>.weight` [N, K] except lm_head, the embeddings, norms and routers
(`mlp.gate`, `block_sparse_moe.gate`, `mlp.router`, Qwen2-MoE's `shared_expert_gate`), which public quantized
checkpoints keep in bf16; the float linears kept are listed in the config's ignore / modules_to_not_convert.
lm_head=True quantizes the lm_head too, as GPTQModel's `lm_head=True` checkpoints and compressed-tensors recipes
without it in `ignore` do: in a small model it is a large share of a decode step's bytes (the default
Qwen3-30B-A3B 4-layer checkpoint: 134 MB of 590 in bf16, half of an int4 step's).
mxfp4 quantizes the experts only, as gpt-oss does: gpt-oss checkpoints get its fused *_blocks / *_scales layout;
other architectures have no gpt-oss-style convention, so their per-expert linears are written in compressed-tensors'
mxfp4-pack-quantized format (which vLLM and compressed-tensors read), attention and dense MLPs kept in bf16.
gpt-oss is only quantized to mxfp4 (its experts are fused [E, ...] tensors that the other layouts do not name).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from cpumoe.loader.checkpoint import CONFIG, INDEX, Checkpoint
from cpumoe.loader.quantized.awq import Awq
from cpumoe.loader.quantized.common import FLOATS, Layout
from cpumoe.loader.quantized.compressed_tensors import CompressedTensors
from cpumoe.loader.quantized.fp8 import BlockFp8
from cpumoe.loader.quantized.gpt_oss_mxfp4 import GptOssMxfp4
from cpumoe.loader.quantized.gptq import Gptq
from cpumoe.loader.shards import shard_names
from cpumoe.quant.formats import FP8_BLOCK, MXFP4_GROUP, QuantFormat, parse_format
from cpumoe.quant.schemes import quantize

MAX_SHARD_BYTES = 2 * 1024**3
DEFAULT_GROUP = 128
# quant format -> layouts it can be written in, the first the default
LAYOUT_NAMES = {QuantFormat.INT8_W8A8: ("compressed-tensors",),
                QuantFormat.INT4_W4A16: ("compressed-tensors", "gptq", "awq"),
                QuantFormat.FP8_W8A16: ("fp8",),
                QuantFormat.MXFP4_W4A16: ("mxfp4", "compressed-tensors")}
FLOAT_MODULES = ("lm_head", "gate", "router", "shared_expert_gate")  # last name of linears kept in float
GPT_OSS_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


@dataclass
class QuantizeResult:
    path: Path
    layout: str
    quantized: list[str] = field(default_factory=list)    # module prefixes
    unquantized: list[str] = field(default_factory=list)  # float linears kept (the ignore list)
    files: list[str] = field(default_factory=list)


def make_layout(format: str | QuantFormat, layout: str | None = None, *, group_size: int | None = None,
                symmetric: bool | None = None, model_type: str = "") -> Layout:
    """The writer for `format` in `layout` (default: the format's first in LAYOUT_NAMES; mxfp4: gpt-oss's own for
    gpt-oss, compressed-tensors otherwise). ValueError for a combination that has no public layout."""
    fmt = parse_format(format)
    if layout is None:
        layout = ("mxfp4" if model_type == "gpt_oss" else "compressed-tensors") \
            if fmt is QuantFormat.MXFP4_W4A16 else LAYOUT_NAMES[fmt][0]
    if layout not in LAYOUT_NAMES[fmt]:
        raise ValueError(f"{fmt.value} cannot be written as {layout!r}; choose from {', '.join(LAYOUT_NAMES[fmt])}")
    if model_type == "gpt_oss" and layout != "mxfp4":
        raise ValueError("gpt-oss is quantized only to mxfp4 in its own layout (its experts are fused [E, ...] "
                         "tensors that the other layouts do not name)")
    if layout == "mxfp4" and model_type != "gpt_oss":
        raise ValueError("the mxfp4 (gpt-oss) layout names gpt-oss's fused experts; use --layout "
                         "compressed-tensors for other models")
    if fmt is QuantFormat.MXFP4_W4A16 and group_size not in (None, MXFP4_GROUP):
        raise ValueError(f"mxfp4 groups are {MXFP4_GROUP} values, got --group-size {group_size}")
    g = group_size or (FP8_BLOCK if fmt is QuantFormat.FP8_W8A16 else DEFAULT_GROUP)
    if g <= 0:
        raise ValueError(f"group size must be positive, got {g}")
    if fmt is QuantFormat.FP8_W8A16:
        return BlockFp8(g, g)
    if layout == "gptq":
        return Gptq(g, True if symmetric is None else symmetric)
    if layout == "awq":
        return Awq(g, zero_point=not symmetric)  # AWQ is asymmetric unless asked
    if layout == "mxfp4":
        return GptOssMxfp4()
    return CompressedTensors(fmt, g, True if symmetric is None else symmetric)


def is_float_module(prefix: str) -> bool:
    """Linears public quantized checkpoints keep in float: lm_head, routers, embeddings, norms."""
    last = prefix.rsplit(".", 1)[-1]
    return last in FLOAT_MODULES or "embed" in last or "norm" in last


@dataclass(frozen=True, slots=True)
class _Step:
    name: str      # the source tensor
    prefix: str    # the module it belongs to ("" for tensors copied as they are)
    transpose: bool = False   # gpt-oss's experts are stored [E, K, N]


def plan(ckpt: Checkpoint, layout: Layout, lm_head: bool = False) -> tuple[list[_Step], list[str]]:
    """Every source tensor's step, and the float linears kept. ValueError naming a linear the layout cannot hold.
    lm_head: quantize the lm_head too."""
    gpt_oss = isinstance(layout, GptOssMxfp4)
    experts_only = layout.format is QuantFormat.MXFP4_W4A16
    if lm_head:
        if experts_only:
            raise ValueError("mxfp4 quantizes the experts only; the lm_head stays in float")
        if ckpt.config_get("tie_word_embeddings", default=False) or "lm_head.weight" not in ckpt:
            raise ValueError(f"{ckpt.path} has no lm_head.weight of its own to quantize (its logits use the tied "
                             "embedding table, which stays in float)")
    steps, kept = [], []
    for name in ckpt.keys():
        shape, dtype = tuple(ckpt.shape(name)), ckpt.dtype(name)
        if gpt_oss:
            if name.endswith(GPT_OSS_EXPERTS) and len(shape) == 3:
                _check(layout, name, shape[-1], shape[-2])  # [E, K, N]
                steps.append(_Step(name, name, transpose=True))
                continue
        elif name.endswith(".weight") and len(shape) == 2 and dtype in FLOATS:
            prefix = name.removesuffix(".weight")
            quantized_head = lm_head and prefix == "lm_head"
            if (is_float_module(prefix) and not quantized_head) or (experts_only and ".experts." not in prefix):
                kept.append(prefix)
            else:
                _check(layout, name, *shape)
                steps.append(_Step(name, prefix))
                continue
        steps.append(_Step(name, ""))
    if not any(s.prefix for s in steps):
        raise ValueError(f"{ckpt.path}: no linear to quantize in this checkpoint")
    return steps, [k for k in kept if "embed" not in k.rsplit(".", 1)[-1]]


def _check(layout: Layout, name: str, N: int, K: int) -> None:
    why = layout.accepts(N, K)
    if why:
        raise ValueError(f"cannot quantize {name!r} [{N}, {K}] to {layout.method} {layout.format.value}: {why}")


def quantize_checkpoint(src: str | Path, dst: str | Path, format: str | QuantFormat, *, layout: str | None = None,
                        group_size: int | None = None, symmetric: bool | None = None, lm_head: bool = False,
                        max_shard_bytes: int = MAX_SHARD_BYTES,
                        progress: Callable[[int, int], None] | None = None) -> QuantizeResult:
    """Write `src` (a float checkpoint directory) to `dst` quantized to `format` in `layout`; see the module doc.
    Streams: one source tensor (and its quantized form) in memory at a time, plus the shard being filled."""
    from safetensors.torch import save_file

    ckpt = Checkpoint(src)
    if ckpt.config_get("quantization_config", default=None):
        raise ValueError(f"{ckpt.path} is already quantized (config.json has a quantization_config)")
    writer = make_layout(format, layout, group_size=group_size, symmetric=symmetric,
                         model_type=ckpt.config_get("model_type", default=""))
    steps, kept = plan(ckpt, writer, lm_head)
    out = Path(dst)
    if out.resolve() == ckpt.path.resolve():
        raise ValueError("the quantized checkpoint must go to another directory than its source")
    out.mkdir(parents=True, exist_ok=True)
    if (out / CONFIG).exists():
        raise ValueError(f"{out} already holds a checkpoint ({CONFIG}); choose an empty directory")
    result = QuantizeResult(out, writer.method, unquantized=kept)

    shards: list[str] = []
    pending: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total = 0

    def flush() -> None:
        name = f"shard-{len(shards):05d}.tmp"
        save_file(pending, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(pending, name))
        shards.append(name)
        pending.clear()

    for done, step in enumerate(steps, start=1):
        tensor = ckpt.read(step.name)
        if step.prefix:
            w = tensor.transpose(-1, -2) if step.transpose else tensor  # [.., N, K]
            qw = quantize(w, writer.format, **_quantize_args(writer))
            tensors = writer.write(step.prefix, qw)
            result.quantized.append(step.prefix)
        else:
            tensors = {step.name: tensor}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if pending and sum(t.numel() * t.element_size() for t in pending.values()) + size > max_shard_bytes:
            flush()
        pending.update(tensors)
        total += size
        if progress:
            progress(done, len(steps))
    if pending:
        flush()
    single = len(shards) == 1 and not (ckpt.path / INDEX).is_file()  # sharded like the source
    result.files = _name_shards(out, shards, weight_map, total, single)
    _write_config(ckpt, out, writer.config(kept))
    _copy_other_files(ckpt.path, out)
    return result


def _quantize_args(writer: Layout) -> dict:
    """cpumoe.quant.quantize's group_size and symmetric for what `writer` stores."""
    if isinstance(writer, BlockFp8):
        return dict(group_size=writer.block_k)
    if isinstance(writer, Awq):
        return dict(group_size=writer.group_size, symmetric=not writer.zero_point)
    if isinstance(writer, (Gptq, CompressedTensors)):
        return dict(group_size=writer.group_size, symmetric=writer.symmetric)
    return {}


def _name_shards(out: Path, shards: list[str], weight_map: dict[str, str], total: int, single: bool) -> list[str]:
    """Rename the temporary shards as the hub does, and write the index (unless one file, like the source)."""
    names = shard_names(len(shards), single_file=single)
    final = dict(zip(shards, names))
    for tmp, name in final.items():
        (out / tmp).rename(out / name)
    if not single:
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def _write_config(ckpt: Checkpoint, out: Path, quantization_config: dict) -> None:
    config = dict(ckpt.config, quantization_config=quantization_config)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _copy_other_files(src: Path, out: Path) -> None:
    """Tokenizer, generation config, chat template, ...: everything but the weights and config.json."""
    for path in src.iterdir():
        if path.name in (CONFIG, INDEX) or path.suffix == ".safetensors":
            continue
        if path.is_dir():
            shutil.copytree(path, out / path.name, dirs_exist_ok=True)
        else:
            shutil.copy2(path, out / path.name)
