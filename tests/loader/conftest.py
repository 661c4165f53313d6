"""Fixtures of the loader tests: a tiny Qwen3-MoE bf16 checkpoint and a tiny gpt-oss one with its MXFP4 twin."""
import pytest
import torch

from cpumoe.loader.quantized.convert import quantize_checkpoint
from cpumoe.synthetic import make_checkpoint, tiny_overrides

PRESET = "qwen3-30b-a3b"


def source_checkpoint(path, **kw):
    return make_checkpoint(PRESET, path, layers=2, vocab=300, overrides=tiny_overrides(PRESET), **kw)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return source_checkpoint(tmp_path_factory.mktemp("bf16"))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny gpt-oss saved by transformers (experts gate_up_proj [E, H, 2I], down_proj [E, I, H]) and its mxfp4."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GptOssConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16, intermediate_size=32,
                                       num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                       layer_types=["sliding_attention", "full_attention"])
    src = tmp_path_factory.mktemp("gpt_oss")
    transformers.GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(src)
    return src, quantize_checkpoint(src, tmp_path_factory.mktemp("gpt_oss_mxfp4"), "mxfp4")
