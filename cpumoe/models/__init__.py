"""Models, picked by config.json's model_type (registry.py), and their declarative weight loading.

Every architecture is one file here holding an Architecture (architecture.py): its config, the modules of its
layers, its presets and its expert layout. Every model is a CausalLM (causal_lm.py) assembled from those modules.
`cpumoe.models.ARCHITECTURES` lists them; the README's table says what each supports.

    load_model(path) -> Checkpoint(path) -> ARCHITECTURES[model_type] -> CausalLM built on the meta device
                     -> every parameter <- the checkpoint tensor of its name, in the model dtype (float32 where the
                        name ends in one of arch.fp32_parameters: routers transformers keeps in float32)
                     -> every MoEBlock <- w13 / w2 stacked expert by expert (arch.expert_weights), or what
                        arch.experts_from_checkpoint reads (transposed, de-interleaved, dequantized) -> FusedMoE packs
                     -> the remaining nn.Linear modules -> PackedLinear

Quantized checkpoints (cpumoe.loader.quantized: compressed-tensors, GPTQ, AWQ, block FP8, MXFP4) keep their format:
each quantized nn.Linear becomes a QuantizedLinear, experts are read as QuantizedWeights one expert at a time and
packed by FusedMoE in that format. A quantized weight that a model reads as a tensor (not through a linear:
DeepSeek's absorbed kv_b_proj) is dequantized to the model dtype, and the log says so.
"""
from __future__ import annotations

import re

from pathlib import Path

import torch
from torch import nn

from cpumoe import ops
from cpumoe.loader import Checkpoint, CheckpointError
from cpumoe.loader.quantized import QuantizedCheckpoint
from cpumoe.logs import logger
from cpumoe.memory import HUGE_PAGES_WANTED, HugePageUse, advised_memory, huge_page_advice
from cpumoe.models.blocks import Attention, ExpertWeights, MoEBlock
from cpumoe.models.causal_lm import CausalLM
from cpumoe.models.packed_linear import QuantizedLinear, pack_linears
from cpumoe.models.registry import ARCHITECTURES, architecture, model_presets
from cpumoe.quant import QuantizedWeight, concat_rows, dequantize

__all__ = ["ARCHITECTURES", "CausalLM", "architecture", "load_model", "load_weights", "model_presets"]


def load_model(path: str | Path, dtype: torch.dtype | None = None, backend: str = "auto") -> nn.Module:
    """Build the model a local checkpoint directory describes and load its weights (dtype: config's by default)."""
    ckpt = Checkpoint(path)
    arch = architecture(ckpt.model_type)
    ckpt = arch.open_checkpoint(ckpt)
    dtype = dtype or ckpt.torch_dtype or torch.float32
    _check_usable(ckpt)
    config = arch.config(ckpt)
    with torch.device("meta"):
        model = CausalLM(arch, config, backend=backend)
    quantized = QuantizedCheckpoint(ckpt)
    first = ops.next_huge_mapping()
    load_weights(model, ckpt, dtype, quantized if quantized.format is not None else None, backend)
    model.huge_pages = advised_memory(ops.huge_mappings_since(first))  # this model's packed weights
    _log_huge_pages(model.huge_pages)
    return model.eval()


def _log_huge_pages(use: HugePageUse) -> None:
    """The packed weights ask for huge pages; where the kernel gave 4 KB pages instead, say so: the weight stream
    then takes a TLB miss every 4 KB."""
    if use.share is None:
        return
    if use.share >= HUGE_PAGES_WANTED:
        logger.info("packed weights: %.2f GB, %.0f%% on 2 MB pages", use.advised_gb, 100 * use.share)
    else:
        logger.warning("packed weights: only %.0f%% of %.2f GB got 2 MB pages; the rest sit on 4 KB pages, which a "
                       "weight stream reads more slowly (%s)", 100 * use.share, use.advised_gb, huge_page_advice())


def _check_usable(ckpt: Checkpoint) -> None:
    """What config.json and the tensors say must agree on what a model can run: top-k within the experts, and no
    weights of layers the config does not have (DeepSeek-V3's multi-token-prediction layers past the last one are
    counted by num_nextn_predict_layers)."""
    top_k = ckpt.config_get("num_experts_per_tok", default=None)
    experts = ckpt.config_get("num_experts", "num_local_experts", "n_routed_experts", default=None)
    if top_k is not None and experts is not None and not 0 < top_k <= experts:
        raise CheckpointError(f"{ckpt.path / 'config.json'}: num_experts_per_tok {top_k} must be in 1..{experts}, "
                              "the number of experts")
    layers = ckpt.config_get("num_hidden_layers") + (ckpt.config_get("num_nextn_predict_layers", default=0) or 0)
    extra = sorted({int(m.group(1)) for key in ckpt.keys()
                    if (m := _LAYER_KEY.match(key)) and int(m.group(1)) >= layers})
    if extra:
        raise CheckpointError(f"{ckpt.path} holds weights of layer {extra[0]}"
                              f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}, but config.json has "
                              f"num_hidden_layers {ckpt.config_get('num_hidden_layers')}")


_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")


def load_weights(model: CausalLM, ckpt: Checkpoint, dtype: torch.dtype, quantized: QuantizedCheckpoint | None = None,
                 backend: str = "auto") -> None:
    """Memory: tensors are read with file reads (Checkpoint.read), not memory-mapped, so the checkpoint's pages are
    never resident beside the model; per-expert checkpoints are read and packed one expert at a time (peak: the
    model + one expert), fused ones ([E, rows, cols] tensors) one layer at a time; the dense projections are packed
    (pack_linears) before the first expert is read. A model whose experts need more
    than stacking (gpt-oss: transposed, gate/up de-interleaved, MXFP4 dequantized, with biases) defines
    experts_from_checkpoint(config, ckpt, prefix, block, dtype) -> the block's load_experts arguments, an
    expert_reader among them (one expert at a time)."""
    arch, config = model.arch, model.config
    fp32 = arch.fp32_parameters
    if quantized is not None:
        _quantized_linears(model, quantized, dtype, backend)
    for name, param in list(model.named_parameters()):
        tensor = _read_dense(ckpt, quantized, name, tuple(param.shape))
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        target = torch.float32 if name.endswith(fp32) else dtype
        setattr(module, attr, nn.Parameter(tensor.to(target).contiguous(), requires_grad=False))
        del tensor
    # Packing a projection holds it twice for a moment (the lm_head can be 10% of a quantized model): done before
    # any expert is read, that moment adds to the dense weights only. The loop's last module is often the
    # lm_head, so drop the names first; then hand the freed buffers back, or the experts' packed stacks settle
    # around them and the loaded model stays ~10% larger than its weights.
    module = param = None
    pack_linears(model, dtype, backend)
    _join_projections(model)
    ops.release_free_memory()
    specs = arch.expert_weights(config)
    for prefix, block in model.named_modules():
        if isinstance(block, MoEBlock):
            custom = arch.experts_from_checkpoint(config, ckpt, prefix, block, dtype)
            _load_block_experts(block, prefix, ckpt, specs, quantized, dtype, custom)
            ops.release_free_memory()  # the layer's transient buffers, before the next layer's stacks settle
    _fuse_decode(model)


def _join_projections(model: CausalLM) -> None:
    """q, k and v as one GEMM in each attention layer whose packed projections can join (Attention.join_projections):
    at decode a projection call has a fixed cost beside its bytes, paid once instead of three times."""
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    why_not = [why for m in attentions if (why := m.join_projections()) is not None]
    if attentions:
        logger.info("q/k/v projections run as one GEMM in %d of %d attention layers%s",
                    len(attentions) - len(why_not), len(attentions),
                    f" (the others run three: {why_not[0]})" if why_not else "")


def _fuse_decode(model: CausalLM) -> None:
    """Decode steps as one C++ call (CausalLM.fuse_decode), or a call a layer, or the log says why not."""
    if not hasattr(model, "fuse_decode"):
        return
    layers_why, step_why = model.fuse_decode()
    if layers_why is not None:
        logger.info("decode steps run the modules (%s)", layers_why)
    elif step_why is not None:
        logger.info("decode steps run each layer as one C++ call (not the whole step: %s)", step_why)
    else:
        logger.info("decode steps run as one C++ call%s", "" if model.decode_step.runs_lm_head
                    else " up to the final norm (the lm_head and the logits run as modules)")


def _load_block_experts(block: MoEBlock, prefix: str, ckpt: Checkpoint, specs: dict,
                        quantized: QuantizedCheckpoint | None, dtype: torch.dtype, custom: dict | None) -> None:
    if custom is not None:  # the architecture read them its own way (Architecture.experts_from_checkpoint)
        block.load_experts(**custom)
        return
    if quantized is not None and _load_quantized_experts(block, prefix, specs, quantized, dtype):
        return
    shapes = block.expert_shapes
    if any(spec.fused is not None and f"{prefix}.{spec.fused}" in ckpt for spec in specs.values()):
        block.load_experts(**{key: _read(ckpt, f"{prefix}.{spec.fused}", shapes[key]).to(dtype).contiguous()
                              for key, spec in specs.items()})
        return

    def read_expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(_read_expert(ckpt, prefix, specs[key], shapes[key][1:], dtype, e) for key in ("w13", "w2"))

    meta = {key: torch.empty(shapes[key], dtype=dtype, device="meta") for key in ("w13", "w2")}
    block.load_experts(meta["w13"], meta["w2"], expert_reader=read_expert)


def _quantized_linears(model: nn.Module, quantized: QuantizedCheckpoint, dtype: torch.dtype, backend: str) -> None:
    """Every nn.Linear stored quantized becomes a QuantizedLinear holding that checkpoint's codes and scales (its
    bias, if any, is then loaded as an ordinary parameter)."""
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        qw = quantized.linear(name)
        if qw is None:
            continue
        if tuple(qw.shape) != (module.out_features, module.in_features):
            raise CheckpointError(f"quantized {name!r} in {quantized.ckpt.path} is {list(qw.shape)}, expected "
                                  f"[{module.out_features}, {module.in_features}]")
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr,
                QuantizedLinear(qw, has_bias=module.bias is not None, dtype=dtype, backend=backend))


def _read_dense(ckpt: Checkpoint, quantized: QuantizedCheckpoint | None, name: str,
                shape: tuple[int, ...]) -> torch.Tensor:
    """A parameter as a tensor; a quantized weight the model reads directly is dequantized (and logged)."""
    if quantized is not None and name.endswith(".weight"):
        qw = quantized.linear(name.removesuffix(".weight"))
        if qw is not None:
            logger.info("%s: %s weight dequantized (the model reads it as a tensor, not through a linear)", name,
                        qw.format.value)
            if tuple(qw.shape) != shape:
                raise CheckpointError(f"quantized {name!r} in {ckpt.path} is {list(qw.shape)}, expected {list(shape)}")
            return dequantize(qw)
    return _read(ckpt, name, shape)


_RELEASE_EVERY_EXPERTS = 16


def _load_quantized_experts(block: MoEBlock, prefix: str, specs: dict[str, ExpertWeights],
                            quantized: QuantizedCheckpoint, dtype: torch.dtype) -> bool:
    """Hands the block its experts as QuantizedWeights read one expert at a time; False when this checkpoint
    stores the block's experts unquantized."""
    def read(key: str, e: int) -> QuantizedWeight | None:
        parts = [quantized.linear(f"{prefix}.{pattern.format(e=e)}".removesuffix(".weight"))
                 for pattern in specs[key].per_expert]
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise CheckpointError(f"experts {specs[key].per_expert} of {prefix} mix quantized and float tensors")
        return parts[0] if len(parts) == 1 else concat_rows(parts)

    first13, first2 = read("w13", 0), read("w2", 0)
    if first13 is None and first2 is None:
        return False
    if first13 is None or first2 is None:
        raise CheckpointError(f"experts of {prefix}: w13 and w2 must both be quantized or both float")
    shapes = block.expert_shapes
    if (block.num_experts, *first13.shape) != shapes["w13"] or (block.num_experts, *first2.shape) != shapes["w2"]:
        raise CheckpointError(f"experts of {prefix}: quantized w13 {list(first13.shape)} and w2 {list(first2.shape)} "
                              f"do not fit {list(shapes['w13'][1:])} and {list(shapes['w2'][1:])}")

    def read_expert(e: int) -> tuple[QuantizedWeight, QuantizedWeight]:
        # Unpacking an expert's codes takes several times its packed bytes in short-lived buffers; handing
        # them back every few experts keeps them from piling up over a layer (~10% of an int4 model). Not
        # every expert: a release costs a few ms, and memory it hands back must be faulted in again.
        if e % _RELEASE_EVERY_EXPERTS == 0:
            ops.release_free_memory()
        return read("w13", e), read("w2", e)

    block.load_experts(first13.meta_stack(block.num_experts), first2.meta_stack(block.num_experts),
                       expert_reader=read_expert, dtype=dtype)
    return True


def _read(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in ckpt:
        raise CheckpointError(f"tensor {name!r} not found in checkpoint {ckpt.path}")
    if tuple(ckpt.shape(name)) != shape:
        raise CheckpointError(f"tensor {name!r} in {ckpt.path} has shape {list(ckpt.shape(name))}, expected {list(shape)}")
    _check_float(ckpt, name)
    return ckpt.read(name)


def _check_float(ckpt: Checkpoint, name: str) -> None:
    """Weights are floats: an integer tensor under a float weight's name is a broken checkpoint, not a cast."""
    if not ckpt.dtype(name).is_floating_point:
        raise CheckpointError(f"tensor {name!r} in {ckpt.path} is {ckpt.dtype(name)}, where a float weight belongs")


def _read_expert(ckpt: Checkpoint, prefix: str, spec: ExpertWeights, shape: tuple[int, ...], dtype: torch.dtype,
                 e: int) -> torch.Tensor:
    """Expert e's [rows, cols]: its per-expert tensors concatenated on their dim 0."""
    out = torch.empty(shape, dtype=dtype)  # [rows, cols]
    row = 0
    for pattern in spec.per_expert:
        name = f"{prefix}.{pattern.format(e=e)}"
        if name not in ckpt:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {ckpt.path}")
        part_shape = ckpt.shape(name)  # [rows_part, cols]
        if len(part_shape) != 2 or part_shape[1] != shape[1] or row + part_shape[0] > shape[0]:
            raise CheckpointError(f"tensor {name!r} in {ckpt.path} has shape {list(part_shape)}, which does "
                                  f"not fit expert rows [{row}:] of {list(shape)}")
        _check_float(ckpt, name)
        dst = out[row:row + part_shape[0]]  # contiguous rows
        if ckpt.dtype(name) == dtype:
            ckpt.read(name, out=dst)  # straight from the file
        else:
            dst.copy_(ckpt.read(name))
        row += part_shape[0]
    if row != shape[0]:
        raise CheckpointError(f"experts {spec.per_expert} of {prefix} fill {row} rows, expected {shape[0]}")
    return out
