"""Models, picked by config.json's model_type, and their declarative weight loading.

Supported (model_type: examples), all one decoder (moe_decoder.py) under a per-architecture ArchSpec:
    qwen3_moe  Qwen3-30B-A3B, Qwen3-235B-A22B        per-head q/k norm
    qwen2_moe  Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B     q/k/v bias, sigmoid-gated shared expert
    mixtral    Mixtral-8x7B, Mixtral-8x22B           block_sparse_moe w1/w3/w2; no sliding window
    olmoe      OLMoE-1B-7B                           q/k norm over the full projections, clip_qkv
    deepseek_v2  DeepSeek-V2, -V2-Lite (yarn RoPE)   MLA (mla.py), grouped routing: own layers, same forward
    deepseek_v3  DeepSeek-V3, -R1, Moonlight         DeepSeek-V2's model with a sigmoid router, correction bias and
                                                     grouped top-k (deepseek_v3.py; router kept in float32)
    gpt_oss    gpt-oss-20b, gpt-oss-120b             attention sinks, sliding/full layers, biased router and experts,
                                                     swigluoai; fused or MXFP4 experts (gpt_oss.py): own layers

    load_model(path) -> Checkpoint(path) -> MODELS[model_type] built on the meta device
                     -> every parameter <- the checkpoint tensor of its name, in the model dtype (float32 where the
                        name ends in one of model.fp32_parameters: routers transformers keeps in float32)
                     -> every MoEBlock <- w13 / w2 stacked expert by expert (model.expert_weights), or what
                        model.experts_from_checkpoint reads (transposed, de-interleaved, dequantized) -> FusedMoE packs
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
from cpumoe.models.blocks import ExpertWeights, MoEBlock
from cpumoe.models.deepseek_v2 import DeepseekV2ForCausalLM
from cpumoe.models.deepseek_v3 import DeepseekV3ForCausalLM
from cpumoe.models.gpt_oss import GptOssForCausalLM
from cpumoe.models.mixtral import MixtralForCausalLM
from cpumoe.models.moe_decoder import MoeDecoderForCausalLM
from cpumoe.models.olmoe import OlmoeForCausalLM
from cpumoe.models.packed_linear import QuantizedLinear, pack_linears
from cpumoe.models.qwen2_moe import Qwen2MoeForCausalLM
from cpumoe.models.qwen3_moe import Qwen3MoeForCausalLM
from cpumoe.quant import QuantizedWeight, concat_rows, dequantize

MODELS: dict[str, type[MoeDecoderForCausalLM]] = {
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "mixtral": MixtralForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}

__all__ = ["MODELS", "load_model", "load_weights", "model_class"]


def model_class(model_type: str) -> type[MoeDecoderForCausalLM]:
    if model_type not in MODELS:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(MODELS))}")
    return MODELS[model_type]


def load_model(path: str | Path, dtype: torch.dtype | None = None, backend: str = "auto") -> nn.Module:
    """Build the model a local checkpoint directory describes and load its weights (dtype: config's by default)."""
    ckpt = Checkpoint(path)
    cls = model_class(ckpt.model_type)
    dtype = dtype or ckpt.torch_dtype or torch.float32
    _check_usable(ckpt)
    config = cls.config_from_checkpoint(ckpt)
    with torch.device("meta"):
        model = cls(config, backend=backend)
    quantized = QuantizedCheckpoint(ckpt)
    load_weights(model, ckpt, dtype, quantized if quantized.format is not None else None, backend)
    return model.eval()


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


def load_weights(model: nn.Module, ckpt: Checkpoint, dtype: torch.dtype, quantized: QuantizedCheckpoint | None = None,
                 backend: str = "auto") -> None:
    """Memory: tensors are read with file reads (Checkpoint.read), not memory-mapped, so the checkpoint's pages are
    never resident beside the model; per-expert checkpoints are read and packed one expert at a time (peak: the
    model + one expert), fused ones ([E, rows, cols] tensors) one layer at a time; the dense projections are packed
    (pack_linears) before the first expert is read. A model whose experts need more
    than stacking (gpt-oss: transposed, gate/up de-interleaved, MXFP4 dequantized, with biases) defines
    experts_from_checkpoint(ckpt, prefix, block, dtype) -> the block's load_experts arguments, an expert_reader
    among them (one expert at a time)."""
    fp32 = tuple(getattr(model, "fp32_parameters", ()))
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
    ops.release_free_memory()
    specs = model.expert_weights
    experts_from_checkpoint = getattr(model, "experts_from_checkpoint", None)
    for prefix, block in model.named_modules():
        if isinstance(block, MoEBlock):
            _load_block_experts(block, prefix, ckpt, specs, quantized, dtype, experts_from_checkpoint)
            ops.release_free_memory()  # the layer's transient buffers, before the next layer's stacks settle


def _load_block_experts(block: MoEBlock, prefix: str, ckpt: Checkpoint, specs: dict,
                        quantized: QuantizedCheckpoint | None, dtype: torch.dtype, experts_from_checkpoint) -> None:
    if experts_from_checkpoint is not None:
        block.load_experts(**experts_from_checkpoint(ckpt, prefix, block, dtype))
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
