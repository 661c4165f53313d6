"""DeepSeek-V2 (MLA attention, dense first layer, shared expert, greedy / group-limited routing) against transformers:
a tiny random DeepseekV2ForCausalLM saved with save_pretrained and loaded by cpumoe.models.load_model gives the same
prefill logits, the same greedy tokens without a cache, and the engine (paged KV cache, whole prompt and chunked
prefill) generates what transformers' generate does; with default RoPE and with yarn (the published checkpoints'
parameters, in their legacy config.json form, and a short-context variant where yarn's frequency ramp and attention
factor matter at these prompt lengths).

Tolerance: max |ours - theirs| / max |theirs| over the logits <= 1e-4 in fp32.
"""
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cpumoe.engine.kv_cache import KVCacheLayout  # noqa: E402
from cpumoe.loader import Checkpoint, CheckpointError  # noqa: E402
from cpumoe.models import ARCHITECTURES, load_model  # noqa: E402
from cpumoe.models.blocks import GatedMLP  # noqa: E402
from cpumoe.models.deepseek_v2 import DeepseekV2MoE  # noqa: E402
from tests.models.tiny import (engine_greedy, generate_reference, greedy_without_cache, min_router_margin,
                               prefill_error, rel_err, spread_weights_)  # noqa: E402

TOL = 1e-4
PROMPT = torch.tensor([[111, 87, 25, 71, 115, 92, 74, 62, 46, 32, 88]])  # [1, T]
# v_head_dim (12) < qk_head_dim (16 + 8): V is padded in the cache. routed_scaling_factor != 1 so scaling shows.
BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
            moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            routed_scaling_factor=1.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            eos_token_id=None)  # else generate's min_new_tokens bans token 2, which these models like to pick
VARIANTS = {
    "greedy-q-proj": dict(topk_method="greedy", q_lora_rank=None),
    # topk_group=1 < top_k: grouping changes the choice (ignoring it moves the logits by ~20%)
    "grouped-q-lora-bias": dict(topk_method="group_limited_greedy", n_group=4, topk_group=1, q_lora_rank=24,
                                attention_bias=True),
    "grouped-q-proj-v-wide": dict(topk_method="group_limited_greedy", n_group=2, topk_group=1, q_lora_rank=None,
                                  v_head_dim=32, qk_nope_head_dim=8),  # V wider than K: K and q padded
    # DeepSeek-V2 / V2-Lite's RoPE: factor 40 over 4096 positions, mscale == mscale_all_dim (cos/sin factor 1, softmax
    # scale x mscale^2). Its config.json is rewritten to the published form (rope_scaling, "type", top-level theta).
    "yarn-v2-lite": dict(topk_method="greedy", q_lora_rank=None, max_position_embeddings=163840, rope_parameters={
        "rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 1e4}),
    # original_max_position_embeddings 16: the ramp covers these positions; mscale != mscale_all_dim: cos/sin scaled
    "yarn-short-q-lora": dict(topk_method="group_limited_greedy", n_group=4, topk_group=1, q_lora_rank=24,
                              max_position_embeddings=64, rope_parameters={
                                  "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                  "beta_fast": 8, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5,
                                  "rope_theta": 1e4}),
}
LEGACY_ROPE_CONFIG = {"yarn-v2-lite"}


def tiny_model(**overrides):
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**{**BASE, **overrides}))
    return spread_weights_(model).float().eval()


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request, tmp_path_factory):
    model = tiny_model(**VARIANTS[request.param])
    path = tmp_path_factory.mktemp(f"deepseek_v2_{request.param}")
    model.save_pretrained(path)
    if request.param in LEGACY_ROPE_CONFIG:
        write_legacy_rope_config(path)
    return request.param, model, path


def write_legacy_rope_config(path):
    """config.json as the published DeepSeek-V2 checkpoints have it: rope_scaling with "type", theta at the top."""
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(config))


def test_registered_and_layers(pair):
    name, _, path = pair
    ckpt = Checkpoint(path)
    assert ckpt.model_type == "deepseek_v2" and "deepseek_v2" in ARCHITECTURES
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in set(ckpt.keys())
    ours = load_model(path)
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP, DeepseekV2MoE, DeepseekV2MoE]
    assert ours.model.layers[1].mlp.shared_experts is not None
    c = ours.config
    assert ours.kv_cache_layout == KVCacheLayout(num_kv_heads=1, k_dim=c.kv_lora_rank + c.qk_rope_head_dim, v_dim=0)


def test_prefill_logits_match(pair):
    name, model, path = pair
    assert min_router_margin(model, PROMPT) > 1e-4, "routing near-tie (fp32 noise is ~1e-6): the prompt no longer suits this test"
    err = prefill_error(path, model, PROMPT)
    assert err <= TOL, f"{name}: max abs diff / max |logit| = {err:.2e} > {TOL:.0e}"


def test_greedy_decode_matches(pair):
    name, model, path = pair
    ours, theirs = greedy_without_cache(load_model(path), model, PROMPT)
    assert ours == theirs, name


@pytest.mark.parametrize("budget", [512, 4], ids=["whole-prompt", "chunks-of-4"])
def test_engine_greedy_matches_generate(pair, budget):
    name, model, path = pair
    ref = generate_reference(model, PROMPT)
    assert engine_greedy(path, [PROMPT[0].tolist()], budget=budget) == [ref], f"{name}, budget {budget}"


def test_latent_cache_bytes_v2_lite():
    """DeepSeek-V2-Lite's shapes (27 layers, 16 heads, kv_lora_rank 512, rope 64, nope 128, v 128), bf16: the latent
    cache keeps 576 values per token and layer, 31,104 bytes per token; per-head K and V padded to 192 took 331,776."""
    arch = ARCHITECTURES["deepseek_v2"]
    c = arch.preset_config(next(p for p in arch.presets if p.name == "deepseek-v2-lite"))
    latent = arch.kv_cache_layout(c).bytes_per_token(num_layers=c.num_hidden_layers, dtype=torch.bfloat16)
    expanded = 2 * c.num_hidden_layers * c.num_attention_heads * 192 * torch.bfloat16.itemsize
    assert (latent, expanded) == (31_104, 331_776)


@pytest.mark.parametrize("budget", [512, 4], ids=["whole-prompt", "chunks-of-4"])
def test_engine_batch_of_two_matches_single(tmp_path, budget):
    """Two sequences of different lengths in one batch: the paged MLA cache keeps them apart."""
    name, path = "grouped-q-proj-v-wide", tmp_path
    tiny_model(**VARIANTS[name]).save_pretrained(path)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :5].tolist()]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    config = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=budget)  # 4: decodes beside chunks
    together = [o.new_token_ids for o in LLMEngine(path, config=config).generate(prompts, params)]
    alone = [LLMEngine(path, config=config).generate([p], params)[0].new_token_ids for p in prompts]
    assert together == alone, name


@pytest.mark.parametrize("name", [name for name in VARIANTS if name.startswith("yarn")])
def test_yarn_scaling(name, tmp_path):
    """The yarn variants: softmax scale x mscale(factor, mscale_all_dim)^2, and yarn does move the logits (the same
    weights under default RoPE differ by far more than the tolerance)."""
    model, path = tiny_model(**VARIANTS[name]), tmp_path
    model.save_pretrained(path)
    rope = VARIANTS[name]["rope_parameters"]
    attn = load_model(path).model.layers[0].self_attn
    mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
    assert attn.scaling == pytest.approx(attn.qk_head_dim ** -0.5 * mscale ** 2, rel=1e-12)
    assert attn.rope_scaling["rope_type"] == "yarn"
    unscaled = tiny_model(**{**VARIANTS[name], "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    with torch.no_grad():
        err = rel_err(unscaled(PROMPT).logits, model(PROMPT).logits)
    assert err > 100 * TOL, f"{name}: yarn changes the logits by only {err:.1e}"


@pytest.mark.parametrize("edit, match", [
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}), "rope type 'dynamic'"),
    (dict(rope_parameters=None, rope_scaling={"type": "longrope", "factor": 4.0}), "rope type 'longrope'"),
    (dict(topk_method="noaux_tc"), "topk_method 'noaux_tc'"),
], ids=["dynamic", "longrope-rope-scaling", "noaux-tc"])
def test_unsupported_configs_are_refused(edit, match, tmp_path):
    tiny_model(**VARIANTS["greedy-q-proj"]).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        load_model(tmp_path)


def test_bf16_model_keeps_router_float32(tmp_path):
    """transformers keeps mlp.gate.weight float32 in a bf16 model, and save_pretrained writes it so; cpumoe keeps those
    float32 values as they are (rounding them to bf16 can change expert choices)."""
    model = tiny_model(**VARIANTS["greedy-q-proj"])
    model.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.bfloat16)
    gate = ours.model.layers[1].mlp.gate
    assert (ours.model.embed_tokens.weight.dtype, gate.weight.dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(gate.weight, model.model.layers[1].mlp.gate.weight, rtol=0, atol=0)
