"""cpumoe.models.rope against transformers' own RoPE init functions (ROPE_INIT_FUNCTIONS, and the default one of a
model's rotary class): from the same config.json values, inv_freq agrees bit for bit in float32 and the attention
factor exactly; RotaryEmbedding's cos/sin carry the attention factor as transformers' do."""
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from cpumoe.models.blocks import RotaryEmbedding  # noqa: E402
from cpumoe.models.rope import SUPPORTED, rope_from_config, rope_parameters  # noqa: E402

# (head_dim, max_position_embeddings, rope dict as config.json holds it)
CASES = {
    "default": (64, 4096, {"rope_type": "default", "rope_theta": 1e6}),
    "default-legacy-no-dict": (128, 4096, None),
    "linear": (64, 4096, {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}),
    "linear-legacy-type": (96, 4096, {"type": "linear", "factor": 2.0}),
    # DeepSeek-V2's published parameters (rotary dim 64)
    "yarn-deepseek-v2": (64, 163840, {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # gpt-oss's: no truncation of the correction range
    "yarn-gpt-oss": (64, 131072, {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000}),
    # Qwen3's long-context recipe: original_max_position_embeddings from max_position_embeddings, beta defaults
    "yarn-qwen3-defaults": (128, 32768, {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
    "yarn-mscale-only": (64, 8192, {"rope_type": "yarn", "factor": 8.0, "mscale": 1.0,
                                    "original_max_position_embeddings": 2048}),
    "yarn-attention-factor": (32, 8192, {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.9,
                                         "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": 4096}),
    "yarn-no-factor": (64, 16384, {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096}),
    "llama3": (128, 131072, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_theta": 5e5}),
}


def theirs(head_dim, max_pos, rope):
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=max_pos, rope_theta=1e4,
                                      rope_parameters=None if rope is None else dict(rope))
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        return transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config)


def ours(head_dim, max_pos, rope):
    config = {"max_position_embeddings": max_pos, "rope_theta": 1e4}
    if rope is not None:
        config["rope_parameters"] = dict(rope)
    theta, scaling = rope_from_config(config)
    return rope_parameters(head_dim, theta, scaling)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(case):
    head_dim, max_pos, rope = CASES[case]
    inv_freq, factor = ours(head_dim, max_pos, rope)
    ref_inv_freq, ref_factor = theirs(head_dim, max_pos, rope)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (head_dim // 2,)
    torch.testing.assert_close(inv_freq, ref_inv_freq.float(), rtol=0, atol=0, msg=f"{case}: inv_freq")
    assert factor == pytest.approx(ref_factor, rel=1e-15), f"{case}: attention factor {factor} vs {ref_factor}"
    if "yarn" in case or case.startswith("linear") or case == "llama3":
        assert not torch.equal(inv_freq, ours(head_dim, max_pos, None)[0]), f"{case}: scaling changed nothing"


def test_deepseek_v2_attention_factor():
    """mscale == mscale_all_dim: the cos/sin factor is 1 (DeepSeek folds mscale^2 into the softmax scale instead)."""
    assert ours(*CASES["yarn-deepseek-v2"])[1] == 1.0
    assert ours(*CASES["yarn-qwen3-defaults"])[1] == pytest.approx(0.1 * math.log(4.0) + 1.0)


@pytest.mark.parametrize("case", ["default", "yarn-gpt-oss", "yarn-qwen3-defaults", "llama3"])
def test_rotary_embedding_cos_sin(case):
    head_dim, max_pos, rope = CASES[case]
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=max_pos, rope_parameters=dict(rope))
    ref = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 5, 17, 39, 129, 4095, 20000])
    theta, scaling = rope_from_config({"max_position_embeddings": max_pos, "rope_parameters": dict(rope)})
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = RotaryEmbedding(head_dim, theta, scaling)(positions, dtype)  # [T, d]
        ref_cos, ref_sin = ref(torch.zeros(1, dtype=dtype), positions[None])  # [1, T, d]
        torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=2e-6, msg=f"{case} {dtype}: cos")
        torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=2e-6, msg=f"{case} {dtype}: sin")


def test_two_argument_rotary_is_default():
    cos, sin = RotaryEmbedding(16, 1e4)(torch.arange(5), torch.float32)
    inv_freq, _ = rope_parameters(16, 1e4)
    angles = torch.arange(5).float()[:, None] * inv_freq
    torch.testing.assert_close(cos, angles.cos().repeat(1, 2), rtol=0, atol=0, msg="default cos")
    torch.testing.assert_close(sin, angles.sin().repeat(1, 2), rtol=0, atol=0, msg="default sin")


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"type": "longrope", "factor": 2.0},
                                  {"rope_type": "su"}], ids=["dynamic", "longrope", "unknown"])
def test_unsupported_types_are_refused(rope):
    kind = rope.get("rope_type", rope.get("type"))
    with pytest.raises(ValueError, match=f"rope type '{kind}' is not supported; supported: {', '.join(SUPPORTED)}"):
        rope_from_config({"rope_parameters": rope})
    with pytest.raises(ValueError, match=f"rope type '{kind}'"):
        rope_parameters(64, 1e4, rope)


def test_missing_parameters_are_named():
    with pytest.raises(ValueError, match="'original_max_position_embeddings'"):
        rope_parameters(64, 1e4, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="nested per layer type"):
        rope_from_config({"rope_parameters": {"full_attention": {"rope_type": "default"},
                                              "sliding_attention": {"rope_type": "default"}}})
