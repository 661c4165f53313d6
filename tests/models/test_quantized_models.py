"""Quantized checkpoints of every public layout cpumoe reads, written by `cpumoe quantize` from a tiny synthetic
Qwen3-MoE, load in their format (QuantizedLinear projections, quantized experts on a native path) and agree with
the model whose weights are their dequantized values (a bf16 "twin" checkpoint) within a budget per format:

    A16 format (fp8): the same weights in bf16, another summation order: bf16 rounding only.
    A8 formats (int8, int4, mxfp4): activations also quantized to int8 per token before every linear and expert
    GEMM, the error that W8A8 checkpoints accept.
The budget is on logits, relative to the largest |logit|, on a prompt of 12 tokens."""
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from cpumoe.engine import AsyncEngine, LLMEngine, SamplingParams
from cpumoe.engine.config import EngineConfig
from cpumoe.loader import Checkpoint
from cpumoe.loader.quantized import QuantizedCheckpoint
from cpumoe.loader.quantized.convert import quantize_checkpoint
from cpumoe.models import load_model
from cpumoe.models.blocks import MoEBlock
from cpumoe.models.packed_linear import QuantizedLinear
from cpumoe.quant import dequantize
from cpumoe.server import create_app
from tests.loader.conftest import source_checkpoint
from tests.server.serving import running_server

openai = pytest.importorskip("openai")

LAYOUTS = {
    "int8-compressed-tensors": dict(format="int8"),
    "int4-compressed-tensors": dict(format="int4", group_size=32),
    "int4-compressed-tensors-asym": dict(format="int4", group_size=32, symmetric=False),
    "int4-gptq": dict(format="int4", layout="gptq", group_size=32),
    "int4-awq": dict(format="int4", layout="awq", group_size=32),
    "fp8-block": dict(format="fp8"),
    "mxfp4-compressed-tensors": dict(format="mxfp4"),
    "int4-compressed-tensors-lm-head": dict(format="int4", group_size=32, lm_head=True),
}
BUDGET = {"int8_w8a8": 0.03, "int4_w4a16": 0.03, "fp8_w8a16": 0.015, "mxfp4_w4a16": 0.03}  # measured: 0.012, 0.011-0.015, 0.007, 0.007
PROMPT = torch.tensor([[5, 17, 42, 99, 7, 250, 3, 61, 128, 200, 33, 8]])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return source_checkpoint(tmp_path_factory.mktemp("bf16"))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def quantized(request, source, tmp_path_factory):
    dst = tmp_path_factory.mktemp(request.param)
    quantize_checkpoint(source, dst, **LAYOUTS[request.param])
    return request.param, dst


def dequantized_twin(src, quantized_dir, dst):
    """The source checkpoint with every quantized module's weight replaced by its dequantized value (bf16)."""
    qc, ckpt = QuantizedCheckpoint(quantized_dir), Checkpoint(src)
    tensors = {}
    for name in ckpt.keys():
        tensor = ckpt.read(name)
        if name.endswith(".weight"):
            qw = qc.linear(name.removesuffix(".weight"))
            if qw is not None:
                tensor = dequantize(qw).to(torch.bfloat16)
        tensors[name] = tensor
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    return dst


def test_loads_quantized_and_matches_dequantized_twin(quantized, source, tmp_path):
    name, path = quantized
    fmt = QuantizedCheckpoint(path).format.value
    model = load_model(path, dtype=torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if fmt != "mxfp4_w4a16":  # an MXFP4 checkpoint quantizes the experts only, as gpt-oss does
        assert linears and all(m.format.value == fmt and m.backend != "naive" for m in linears), name
    experts = [m.experts for m in model.modules() if isinstance(m, MoEBlock)]
    assert experts and all(e.quantization == fmt and e.backend != "naive" for e in experts), name
    assert isinstance(model.lm_head, QuantizedLinear) == LAYOUTS[name].get("lm_head", False), name
    twin = load_model(dequantized_twin(source, path, tmp_path / "twin"), dtype=torch.bfloat16)
    out, ref = model(PROMPT).float(), twin(PROMPT).float()
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err <= BUDGET[fmt], f"{name}: logits differ from the dequantized twin's by {err:.3g} of the max"


def test_serves_through_the_openai_api(quantized):
    """The server over the quantized model answers the openai client with the offline engine's greedy tokens."""
    name, path = quantized
    offline = LLMEngine(str(path), dtype=torch.bfloat16).generate(["Mixture of experts"], SamplingParams(
        max_tokens=6, temperature=0.0))[0]
    engine = AsyncEngine.from_path(path, dtype=torch.bfloat16, config=EngineConfig(num_blocks=32, max_model_len=128),
                                   model_name="q")
    try:
        with running_server(create_app(engine, model_name="q")) as url:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as client:
                done = client.completions.create(model="q", prompt="Mixture of experts", max_tokens=6, temperature=0)
    finally:
        engine.shutdown()
    assert done.usage.completion_tokens == 6, name
    assert done.choices[0].text == offline.new_text, name
