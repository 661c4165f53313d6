"""cpumoe quantize and the quantized checkpoint reader, per layout: a tiny Qwen3-MoE checkpoint (the real hub names,
from cpumoe's synthetic writer) quantized, then every module read back as the QuantizedWeight that
cpumoe.quant.quantize makes of the source weight (the same quantizer: codes and scales exactly; GPTQ/AWQ scales are
fp16 on disk, so rounded to fp16); and the bad inputs each give a CheckpointError naming the tensor.

Cross-checks with other readers of the same bytes are in test_quantized_crosscheck.py."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpumoe.loader import Checkpoint, CheckpointError
from cpumoe.loader.quantized import QuantizedCheckpoint
from cpumoe.loader.quantized.convert import quantize_checkpoint
from cpumoe.quant.formats import QuantFormat
from cpumoe.quant.schemes import dequantize, quantize
from cpumoe.synthetic import make_checkpoint, tiny_overrides
from tests.loader.conftest import PRESET, source_checkpoint

EXPERTS = "model.layers.1.mlp.experts"
# id -> quantize_checkpoint arguments. Tiny Qwen3: K is 64 (hidden) or 32 (expert I), so int4 groups of 32.
CASES = {
    "int8-compressed-tensors": dict(format="int8"),
    "int4-compressed-tensors": dict(format="int4", group_size=32),
    "int4-compressed-tensors-asym": dict(format="int4", group_size=32, symmetric=False),
    "int4-gptq": dict(format="int4", layout="gptq", group_size=32),
    "int4-gptq-asym": dict(format="int4", layout="gptq", group_size=32, symmetric=False),
    "int4-awq": dict(format="int4", layout="awq", group_size=32),
    "fp8-block": dict(format="fp8"),
    "fp8-block-32": dict(format="fp8", group_size=32),
    "mxfp4-compressed-tensors": dict(format="mxfp4"),
    "int4-compressed-tensors-lm-head": dict(format="int4", group_size=32, lm_head=True),
    "int8-compressed-tensors-lm-head": dict(format="int8", lm_head=True),
}
# relative error of the dequantized weight, per format (round to nearest on N(0, 0.02) weights)
ERROR = {QuantFormat.INT8_W8A8: 0.02, QuantFormat.INT4_W4A16: 0.2, QuantFormat.FP8_W8A16: 0.05,
         QuantFormat.MXFP4_W4A16: 0.25}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, source, tmp_path_factory):
    args = CASES[request.param]
    result = quantize_checkpoint(source, tmp_path_factory.mktemp(request.param), **args)
    return args, result


def expected(weight: torch.Tensor, args: dict):
    """What the reader must give: the quantizer's output (GPTQ/AWQ scales rounded to fp16, as stored)."""
    layout = args.get("layout")
    symmetric = args.get("symmetric", layout != "awq")
    ref = quantize(weight, args["format"], group_size=args.get("group_size"), symmetric=symmetric)
    if layout in ("gptq", "awq"):
        ref.scales = ref.scales.half().float()
    return ref


def test_every_module_reads_back_as_quantized(case, source):
    args, result = case
    src, qc = Checkpoint(source), QuantizedCheckpoint(result.path)
    assert result.quantized and qc.format is not None
    for prefix in result.quantized:
        qw, weight = qc.linear(prefix), src.read(f"{prefix}.weight")
        ref = expected(weight, args)
        qw.validate(prefix)
        assert qw.format is ref.format and qw.group_size == ref.group_size, prefix
        assert torch.equal(qw.qweight.view(torch.uint8), ref.qweight.view(torch.uint8)), f"{prefix}: codes"
        assert torch.equal(qw.scales, ref.scales), f"{prefix}: scales"
        assert (qw.zeros is None) == (ref.zeros is None), f"{prefix}: zero points"
        if qw.zeros is not None:
            assert torch.equal(qw.zeros, ref.zeros), f"{prefix}: zero points"
        assert torch.equal(dequantize(qw), dequantize(ref)), f"{prefix}: dequantized"
        err = (dequantize(qw) - weight.float()).norm() / weight.float().norm()
        assert err < ERROR[qw.format], f"{prefix}: relative error {err:.3f}"


def test_float_modules_and_other_tensors_are_kept(case, source):
    args, result = case
    src, out, qc = Checkpoint(source), Checkpoint(result.path), QuantizedCheckpoint(result.path)
    assert "model.layers.0.mlp.gate" in result.unquantized
    assert ("lm_head" in result.quantized) == args.get("lm_head", False) != ("lm_head" in result.unquantized)
    if args["format"] == "mxfp4":  # experts only
        assert "model.layers.0.self_attn.q_proj" in result.unquantized
        assert all(".experts." in p for p in result.quantized)
    for prefix in result.unquantized:
        assert qc.linear(prefix) is None, prefix
    quantized = {f"{p}.weight" for p in result.quantized}
    for name in src.keys():
        if name not in quantized:
            assert torch.equal(out.read(name), src.read(name)), f"{name} not copied as is"
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (result.path / f).read_bytes() == (source / f).read_bytes()
    config = json.loads((result.path / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["quantization_config"]["quant_method"] == result.layout
    if result.layout == "gptq":  # the flag GPTQModel and vLLM read
        assert config["quantization_config"]["lm_head"] == args.get("lm_head", False)


def test_expert_reads_the_per_expert_module(case):
    _, result = case
    qc = QuantizedCheckpoint(result.path)
    for projection in ("gate_proj", "up_proj", "down_proj"):
        a, b = qc.expert(EXPERTS, projection, 3), qc.linear(f"{EXPERTS}.3.{projection}")
        assert torch.equal(a.qweight.view(torch.uint8), b.qweight.view(torch.uint8)) and torch.equal(a.scales, b.scales)


def test_unquantized_checkpoint_reads_none(source):
    qc = QuantizedCheckpoint(source)
    assert qc.format is None and qc.linear("model.layers.0.self_attn.q_proj") is None


def test_sharded_source_and_output(tmp_path):
    src = source_checkpoint(tmp_path / "src", max_shard_bytes=40_000)
    assert (src / "model.safetensors.index.json").is_file()
    result = quantize_checkpoint(src, tmp_path / "q", "int4", group_size=32, max_shard_bytes=20_000)
    assert len(result.files) > 1 and result.files[0] == f"model-00001-of-{len(result.files):05d}.safetensors"
    index = json.loads((result.path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(result.files)
    assert not list(result.path.glob("*.tmp"))
    out = Checkpoint(result.path)
    assert index["metadata"]["total_size"] == sum(out.read(n).nbytes for n in out.keys())
    ref = quantize(Checkpoint(src).read(f"{EXPERTS}.0.down_proj.weight"), "int4", group_size=32)
    assert torch.equal(QuantizedCheckpoint(out).expert(EXPERTS, "down_proj", 0).qweight, ref.qweight)


# ---- gpt-oss: its fused MXFP4 experts -----------------------------------------------------------------------------

def test_gpt_oss_mxfp4_experts(gpt_oss):
    src, result = gpt_oss
    assert result.layout == "mxfp4"
    config = json.loads((result.path / "config.json").read_text())["quantization_config"]
    assert config == {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    out, qc, source = Checkpoint(result.path), QuantizedCheckpoint(result.path), Checkpoint(src)
    prefix = "model.layers.1.mlp.experts"
    assert out.shape(f"{prefix}.gate_up_proj_blocks") == (4, 64, 2, 16)
    assert out.shape(f"{prefix}.down_proj_scales") == (4, 64, 1)
    assert f"{prefix}.gate_up_proj" not in out and f"{prefix}.gate_up_proj_bias" in out
    assert qc.linear("model.layers.1.self_attn.q_proj") is None  # attention stays bf16
    for projection in ("gate_up_proj", "down_proj"):
        for e in range(4):
            ref = quantize(source.read(f"{prefix}.{projection}", index=e).T, "mxfp4")  # W [N, K]
            qw = qc.expert(prefix, projection, e)
            assert torch.equal(qw.qweight, ref.qweight) and torch.equal(qw.scales, ref.scales), (projection, e)
        stack = qc.linear(f"{prefix}.{projection}")
        assert stack.shape[0] == 4 and torch.equal(stack[2].qweight, qc.expert(prefix, projection, 2).qweight)


def test_gpt_oss_only_mxfp4(gpt_oss, tmp_path):
    src, _ = gpt_oss
    with pytest.raises(ValueError, match="gpt-oss is quantized only to mxfp4"):
        quantize_checkpoint(src, tmp_path / "q", "int8")


# ---- bad inputs ---------------------------------------------------------------------------------------------------

def edited(path, dst, tensors=None, config=None):
    """A copy of the one-file checkpoint `path` with tensors(dict) -> dict and config(dict) applied."""
    shutil.copytree(path, dst)
    if tensors:
        save_file(tensors(load_file(dst / "model.safetensors")), dst / "model.safetensors")
    if config:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


@pytest.fixture(scope="module")
def int4(source, tmp_path_factory):
    return quantize_checkpoint(source, tmp_path_factory.mktemp("int4"), "int4", group_size=32).path


@pytest.fixture(scope="module")
def gptq(source, tmp_path_factory):
    return quantize_checkpoint(source, tmp_path_factory.mktemp("gptq"), "int4", layout="gptq", group_size=32).path


Q = "model.layers.0.self_attn.q_proj"


def drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def replace(name, fn):
    return lambda t: {**t, name: fn(t[name])}


def qc_config(key, value):
    return lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].__setitem__(key, value)


@pytest.mark.parametrize("tensors, config, match", [
    (drop(f"{Q}.weight_scale"), None, f"{Q}.weight_scale"),
    (drop(f"{Q}.weight_packed"), None, f"{Q}.weight_packed"),
    (replace(f"{Q}.weight_shape", lambda s: s + torch.tensor([0, 8])), None, f"{Q}.weight_packed.*shape"),
    (replace(f"{Q}.weight_packed", lambda p: p[:, :-1].contiguous()), None, f"{Q}.weight_packed.*shape"),
    (replace(f"{Q}.weight_scale", lambda s: s[:, :1].contiguous()), None, f"{Q}.weight_scale.*shape"),
    (replace(f"{Q}.weight_scale", lambda s: s.to(torch.int32)), None, f"{Q}.weight_scale.*int32"),
    (None, qc_config("group_size", 48), f"{Q}.weight_packed.*group size 48 does not divide K=64"),
    (None, qc_config("symmetric", False), f"{Q}.weight_zero_point"),
], ids=["no-scale", "no-packed", "shape-vs-packed", "short-packed", "scale-shape", "scale-dtype", "group",
        "no-zero-point"])
def test_compressed_tensors_errors_name_the_tensor(int4, tmp_path, tensors, config, match):
    qc = QuantizedCheckpoint(edited(int4, tmp_path / "bad", tensors, config))
    with pytest.raises(CheckpointError, match=match):
        qc.linear(Q)


def permuted_g_idx(g):
    return g[torch.randperm(g.numel(), generator=torch.Generator().manual_seed(0))].contiguous()


@pytest.mark.parametrize("tensors, config, match", [
    (drop(f"{Q}.qzeros"), None, f"{Q}.qzeros"),
    (replace(f"{Q}.qweight", lambda q: q[:-4].contiguous()), None,
     rf"{Q}.qweight.*shape \[4, 64\], expected \[8, 64\]"),
    (replace(f"{Q}.scales", lambda s: s[:1].contiguous()), None, f"{Q}.scales.*shape"),
    (replace(f"{Q}.scales", lambda s: s.to(torch.int16)), None, f"{Q}.scales.*int16"),
    (replace(f"{Q}.g_idx", permuted_g_idx), lambda c: c["quantization_config"].update(desc_act=True),
     f"{Q}.g_idx.*act-order"),
    (drop(f"{Q}.g_idx"), lambda c: c["quantization_config"].update(desc_act=True), f"{Q}.g_idx"),
    (None, lambda c: c["quantization_config"].update(group_size=24), f"{Q}.qweight.*group size 24"),
    (None, lambda c: c["quantization_config"].update(bits=8), "GPTQ with 8 bits"),
], ids=["no-qzeros", "short-qweight", "scale-shape", "scale-dtype", "act-order", "act-order-no-g_idx", "group", "bits"])
def test_gptq_errors_name_the_tensor(gptq, tmp_path, tensors, config, match):
    with pytest.raises(CheckpointError, match=match):
        QuantizedCheckpoint(edited(gptq, tmp_path / "bad", tensors, config)).linear(Q)


def test_unknown_quant_method_is_named(source, tmp_path):
    bad = edited(source, tmp_path / "bad", config=lambda c: c.update(quantization_config={"quant_method": "hqq"}))
    with pytest.raises(CheckpointError, match=r"'hqq' is not supported \(supported: compressed-tensors, gptq, awq, "
                                              r"fp8, mxfp4\)"):
        QuantizedCheckpoint(bad)


def test_fp8_missing_scale_is_named(source, tmp_path):
    path = quantize_checkpoint(source, tmp_path / "fp8", "fp8").path
    bad = edited(path, tmp_path / "bad", drop(f"{Q}.weight_scale_inv"))
    with pytest.raises(CheckpointError, match=f"{Q}.weight_scale_inv.*not found"):
        QuantizedCheckpoint(bad).linear(Q)


def test_gpt_oss_missing_scales_are_named(gpt_oss, tmp_path):
    _, result = gpt_oss
    name = "model.layers.0.mlp.experts.down_proj_scales"
    qc = QuantizedCheckpoint(edited(result.path, tmp_path / "bad", drop(name)))
    with pytest.raises(CheckpointError, match=name):
        qc.expert("model.layers.0.mlp.experts", "down_proj", 1)


@pytest.mark.parametrize("args, match", [
    (dict(format="int4", group_size=48), r"cannot quantize .*\.weight.* group size 48 does not divide K="),
    (dict(format="int8", layout="gptq"), "int8_w8a8 cannot be written as 'gptq'"),
    (dict(format="mxfp4", layout="mxfp4"), "use --layout compressed-tensors"),
    (dict(format="mxfp4", group_size=64), "mxfp4 groups are 32"),
    (dict(format="int3"), "unknown quantization format 'int3'"),
    (dict(format="mxfp4", lm_head=True), "mxfp4 quantizes the experts only"),
], ids=["group", "int8-gptq", "mxfp4-layout", "mxfp4-group", "format", "mxfp4-lm-head"])
def test_quantize_refuses(source, tmp_path, args, match):
    with pytest.raises(ValueError, match=match):
        quantize_checkpoint(source, tmp_path / "q", **args)
    assert not (tmp_path / "q" / "config.json").exists()


def test_quantize_refuses_a_tied_lm_head(tmp_path):
    tied = make_checkpoint(PRESET, tmp_path / "tied", layers=1, vocab=300,
                           overrides=dict(tiny_overrides(PRESET), tie_word_embeddings=True))
    with pytest.raises(ValueError, match="no lm_head.weight of its own"):
        quantize_checkpoint(tied, tmp_path / "q", "int8", lm_head=True)


def test_quantize_refuses_a_quantized_source(int4, tmp_path):
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(int4, tmp_path / "q", "int8")


def test_cli(source, tmp_path):
    """The real command line, as a user runs it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    out = tmp_path / "awq"
    run = subprocess.run([sys.executable, "-m", "cpumoe", "quantize", str(source), str(out), "--format", "int4",
                          "--layout", "awq", "--group-size", "32"], capture_output=True, text=True, env=env, cwd=root)
    assert run.returncode == 0, run.stderr
    assert "linears quantized (awq)" in run.stdout
    assert QuantizedCheckpoint(out).format is QuantFormat.INT4_W4A16
    bad = subprocess.run([sys.executable, "-m", "cpumoe", "quantize", str(source), str(tmp_path / "x"), "--format",
                          "int4", "--group-size", "48"], capture_output=True, text=True, env=env, cwd=root)
    assert bad.returncode == 1 and "cpumoe quantize: error: cannot quantize" in bad.stderr
