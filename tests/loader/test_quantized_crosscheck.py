"""The checkpoints cpumoe quantize writes, read by other code that reads those layouts, against cpumoe's reader
(dequantize(QuantizedCheckpoint.linear(...))):

- compressed-tensors (int8, int4 symmetric and asymmetric, mxfp4): the compressed-tensors library's own compressor
  (the `decompress` that transformers and llm-compressor call) per module; and transformers' whole-model loading
  (CompressedTensorsConfig(dequantize=True)) for int4 symmetric. transformers 5.24 fails to load the others: its
  expert fusing (gate_up_proj from per-expert gate/up) finds no tensors for int-quantized and for asymmetric
  pack-quantized checkpoints ("Concatenate on tensors destined for ...experts.gate_up_proj. Ckpt contains: 0"),
  which the library-level check covers.
- block FP8: transformers' own dequantizer (integrations/finegrained_fp8.py: _dequantize_fp8_weight). Loading the
  model through transformers needs `accelerate`, which this environment does not have.
- gpt-oss MXFP4: transformers' convert_moe_packed_tensors (what it runs to dequantize MXFP4 on CPU).
- GPTQ and AWQ: transformers loads them only through gptqmodel / autoawq (GPU kernels, not installed), so the check
  is against the unpacking those projects publish (AutoGPTQ's dequantize with the zero + 1 of the v1 format;
  AutoAWQ's unpack_awq + reverse_awq_order), written out here independently of cpumoe's packing code.
"""
import pytest
import torch

from cpumoe.loader import Checkpoint
from cpumoe.loader.quantized import QuantizedCheckpoint
from cpumoe.loader.quantized.convert import quantize_checkpoint
from cpumoe.quant.schemes import dequantize

MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj", "model.layers.0.mlp.experts.2.up_proj",
           "model.layers.1.mlp.experts.3.down_proj")


def ours(path, prefix):
    return dequantize(QuantizedCheckpoint(path).linear(prefix))


@pytest.mark.parametrize("args", [dict(format="int8"), dict(format="int4", group_size=32),
                                  dict(format="int4", group_size=32, symmetric=False), dict(format="mxfp4")],
                         ids=["int8", "int4", "int4-asym", "mxfp4"])
def test_compressed_tensors_library_decompresses_the_same(source, tmp_path, args):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    path = quantize_checkpoint(source, tmp_path / "q", **args).path
    ckpt = Checkpoint(path)
    config = QuantizationConfig.model_validate(ckpt.config["quantization_config"])
    compressor = BaseCompressor.load_from_registry(config.format)
    for prefix in MODULES:
        if args["format"] == "mxfp4" and ".experts." not in prefix:
            continue
        state = {n[len(prefix) + 1:]: ckpt.read(n) for n in ckpt.keys() if n.startswith(prefix + ".")}
        theirs = compressor.decompress(state, config.config_groups["group_0"])["weight"]
        assert torch.equal(theirs.float(), ours(path, prefix)), prefix


def test_transformers_loads_compressed_tensors_int4(source, tmp_path):
    pytest.importorskip("compressed_tensors")
    import transformers

    path = quantize_checkpoint(source, tmp_path / "q", "int4", group_size=32).path
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    state = model.state_dict()
    qc = QuantizedCheckpoint(path)
    for prefix in qc.ckpt.keys():
        if prefix.endswith(".weight_packed") and ".experts." not in prefix:
            prefix = prefix.removesuffix(".weight_packed")
            assert torch.equal(state[f"{prefix}.weight"], ours(path, prefix)), prefix
    for layer in range(2):
        experts = f"model.layers.{layer}.mlp.experts"
        for e in range(4):
            gate, up, down = (dequantize(qc.expert(experts, p, e)) for p in ("gate_proj", "up_proj", "down_proj"))
            assert torch.equal(state[f"{experts}.gate_up_proj"][e], torch.cat([gate, up])), (layer, e)
            assert torch.equal(state[f"{experts}.down_proj"][e], down), (layer, e)
    assert torch.equal(state["lm_head.weight"], Checkpoint(source).read("lm_head.weight").float())


@pytest.mark.parametrize("block", [128, 32])
def test_transformers_dequantizes_block_fp8_the_same(source, tmp_path, block):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    path = quantize_checkpoint(source, tmp_path / "q", "fp8", group_size=block).path
    ckpt = Checkpoint(path)
    assert ckpt.config["quantization_config"]["weight_block_size"] == [block, block]
    for prefix in MODULES:
        theirs = _dequantize_fp8_weight(ckpt.read(f"{prefix}.weight"), ckpt.read(f"{prefix}.weight_scale_inv"),
                                        [block, block], torch.float32)
        assert torch.equal(theirs, ours(path, prefix)), prefix


def test_transformers_dequantizes_gpt_oss_mxfp4_the_same(gpt_oss):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, result = gpt_oss
    ckpt, qc = Checkpoint(result.path), QuantizedCheckpoint(result.path)
    for layer in range(2):
        for projection in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{projection}"
            theirs = convert_moe_packed_tensors(ckpt.read(f"{name}_blocks"), ckpt.read(f"{name}_scales"),
                                                dtype=torch.float32)  # [E, K, N], transformers' layout
            for e in range(theirs.shape[0]):
                mine = dequantize(qc.expert(f"model.layers.{layer}.mlp.experts", projection, e))  # [N, K]
                assert torch.equal(theirs[e].T, mine), (name, e)


SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles, nibble i at bits 4i, placed consecutively along `dim`."""
    if dim == 0:
        return ((packed[:, None, :] >> SHIFTS[None, :, None]) & 15).flatten(0, 1)
    return ((packed[:, :, None] >> SHIFTS[None, None, :]) & 15).flatten(1, 2)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_gptq_reference_dequantize(source, tmp_path, symmetric):
    """AutoGPTQ: weight = (qweight nibbles along K) - (qzeros nibbles along N + 1), times scales, via g_idx."""
    path = quantize_checkpoint(source, tmp_path / "q", "int4", layout="gptq", group_size=32, symmetric=symmetric).path
    ckpt = Checkpoint(path)
    assert ckpt.config["quantization_config"]["sym"] is symmetric
    for prefix in MODULES:
        qweight, qzeros = ckpt.read(f"{prefix}.qweight"), ckpt.read(f"{prefix}.qzeros")
        scales, g_idx = ckpt.read(f"{prefix}.scales").float(), ckpt.read(f"{prefix}.g_idx").long()
        weight = _nibbles(qweight, 0)  # [K, N]
        zeros = _nibbles(qzeros, 1) + 1  # [K/g, N]
        theirs = (scales[g_idx] * (weight - zeros[g_idx])).T  # [N, K]
        assert torch.equal(theirs, ours(path, prefix)), prefix


def test_awq_reference_dequantize(source, tmp_path):
    """AutoAWQ: unpack_awq (nibbles along N), reverse_awq_order ([0, 4, 1, 5, 2, 6, 3, 7] within each 8), then
    (iweight - izeros) * scales per group of K."""
    path = quantize_checkpoint(source, tmp_path / "q", "int4", layout="awq", group_size=32).path
    ckpt = Checkpoint(path)
    assert ckpt.config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 32,
                                                  "version": "gemm", "zero_point": True,
                                                  "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate",
                                                                             "model.layers.1.mlp.gate"]}
    for prefix in MODULES:
        qweight, qzeros = ckpt.read(f"{prefix}.qweight"), ckpt.read(f"{prefix}.qzeros")
        scales = ckpt.read(f"{prefix}.scales").float()  # [K/g, N]
        N = scales.shape[1]
        reverse = torch.arange(N).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
        iweight, izeros = _nibbles(qweight, 1)[:, reverse], _nibbles(qzeros, 1)[:, reverse]  # [K, N], [K/g, N]
        groups = torch.arange(iweight.shape[0]) // 32
        theirs = ((iweight - izeros[groups]) * scales[groups]).T
        assert torch.equal(theirs, ours(path, prefix)), prefix
