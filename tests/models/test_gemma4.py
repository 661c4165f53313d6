"""Gemma 4 (MoE) beyond the conformance test (tests/models/test_conformance.py runs its tiny config: sliding and
full layers of different head_dim and KV heads, k = v, proportional RoPE, soft-capping, biases): every norm weight,
router scale and layer scalar random (the conformance models keep them at 1, where a misplaced one goes unseen),
config variants against transformers' Gemma4ForCausalLM, the engine over sliding windows with two requests at
once, the multimodal gemma4 checkpoint's text decoder, the shapes of the real model, and the config values cpumoe
refuses.

Tolerances, as max |ours - theirs| / max |theirs| over the logits: fp32 1e-4, bf16 2e-2.
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cpumoe.attention import KVCacheLayout  # noqa: E402
from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cpumoe.loader import Checkpoint, CheckpointConfig, CheckpointError  # noqa: E402
from cpumoe.models import load_model  # noqa: E402
from cpumoe.models.gemma4 import ARCHITECTURE, RopeSpec, parse_config  # noqa: E402
from cpumoe.models.gemma4_layer import rope_inv_freq  # noqa: E402
from tests.models.tiny import greedy_without_cache, rel_err, spread_weights_  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
PROMPT = torch.tensor([[111, 87, 25, 71, 115, 92, 74, 62, 46, 32, 88, 17, 5]])  # [1, T]
BASE = {**ARCHITECTURE.presets[0].config, "num_hidden_layers": 3, **ARCHITECTURE.tiny, "vocab_size": 128,
        "eos_token_id": None, "pad_token_id": None, "bos_token_id": None}  # no eos: generate runs its length
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16)


def randomize_vectors_(model: torch.nn.Module) -> torch.nn.Module:
    """Norm weights, router scales and per-expert scales around 1, layer scalars in [0.5, 1.5): each its own."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and not name.endswith(".bias"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=generator))
    return model


def prepared(model, dtype=torch.float32):
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return randomize_vectors_(spread_weights_(model)).to(dtype).eval()


def tiny_model(dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    return prepared(transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{**BASE, **overrides})), dtype)


def edit_config(path, remove=(), **changes):
    config = json.loads((path / "config.json").read_text())
    for key in remove:
        config.pop(key)
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def generate(model, ids, tokens=10) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens)
    return out[0, ids.shape[1]:].tolist()


VARIANTS = {
    "tiny": {},
    # the sliding layers narrower than the full ones: theirs repeat in the cache's slots
    "no-k-eq-v": dict(attention_k_eq_v=False),
    "untied-exact-gelu": dict(tie_word_embeddings=False, hidden_activation="gelu"),
    "scaled-proportional-rope-no-cap": dict(
        final_logit_softcapping=None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                            "rope_theta": 10000.0, "factor": 2.0}}),
    "full-first": dict(layer_types=["full_attention", "sliding_attention", "full_attention"], top_k_experts=3),
}


@pytest.mark.parametrize("overrides", list(VARIANTS.values()), ids=list(VARIANTS))
def test_config_variants_match_transformers(overrides, tmp_path):
    model = tiny_model(**overrides)
    model.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    with torch.no_grad():
        theirs = model(PROMPT).logits
    assert rel_err(ours(PROMPT), theirs) <= TOL[torch.float32]
    ids_ours, ids_theirs = greedy_without_cache(ours, model, PROMPT, steps=4)
    assert ids_ours == ids_theirs


def test_bf16_with_every_vector_random(tmp_path):
    """Within 2e-2 of transformers' bf16, or twice its own bf16 error against its fp32 where that is larger (as the
    conformance test: here ~2.4%, rounding through soft-capping and near-tied routing)."""
    model = tiny_model(torch.bfloat16)
    model.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.no_grad():
        theirs = model(PROMPT).logits.float()
        own_error = rel_err(theirs, tiny_model()(PROMPT).logits)
    assert rel_err(ours(PROMPT), theirs) <= max(TOL[torch.bfloat16], 2 * own_error)


def test_global_head_dim_form_of_the_per_layer_shapes(tmp_path):
    """Published config.json files say global_head_dim / num_global_key_value_heads; save_pretrained writes
    per_layer_config. Both read as the same model."""
    model = tiny_model()
    model.save_pretrained(tmp_path)
    assert "per_layer_config" in json.loads((tmp_path / "config.json").read_text())
    with torch.no_grad():
        theirs = model(PROMPT).logits
    edit_config(tmp_path, remove=["per_layer_config"], global_head_dim=BASE["global_head_dim"],
                num_global_key_value_heads=BASE["num_global_key_value_heads"])
    ours = load_model(tmp_path)
    assert ours.config.head_dims == [16, 16, 32] and ours.config.kv_heads == [4, 4, 1]
    assert rel_err(ours(PROMPT), theirs) <= TOL[torch.float32]


@pytest.mark.parametrize("engine", [dict(max_num_batched_tokens=512), dict(max_num_batched_tokens=5),
                                    dict(max_num_batched_tokens=512, batch_invariant=True)],
                         ids=["whole-prompt", "chunks-of-5", "batch-invariant"])
def test_engine_two_requests_over_sliding_windows(engine, tmp_path):
    """Windows of 4 keys over 4-token cache blocks, decodes and prefill chunks of two requests in one step."""
    model = tiny_model()
    model.save_pretrained(tmp_path)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :6].tolist()]
    refs = [generate(model, torch.tensor([p])) for p in prompts]
    llm = LLMEngine(tmp_path, config=EngineConfig(block_size=4, num_blocks=64, **engine))
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [out.new_token_ids for out in outs] == refs


def test_multimodal_checkpoint_runs_its_text_decoder(tmp_path, caplog):
    torch.manual_seed(0)
    text = {k: v for k, v in BASE.items() if not k.endswith("token_id")}
    config = transformers.Gemma4Config(text_config=text, vision_config=VISION, audio_config=None,
                                       eos_token_id=None, pad_token_id=None, bos_token_id=None)
    model = prepared(transformers.Gemma4ForConditionalGeneration(config))
    model.save_pretrained(tmp_path)
    ckpt = Checkpoint(tmp_path)
    assert ckpt.model_type == "gemma4" and any(k.startswith("model.vision_tower.") for k in ckpt.keys())
    with caplog.at_level("INFO", logger="cpumoe"):
        ours = load_model(tmp_path)
    assert "vision_tower" in caplog.text and "embed_vision" in caplog.text
    assert ours.arch is ARCHITECTURE
    with torch.no_grad():
        theirs = model(PROMPT).logits
    assert rel_err(ours(PROMPT), theirs) <= TOL[torch.float32]
    ids_ours, ids_theirs = greedy_without_cache(ours, model, PROMPT, steps=4)
    assert ids_ours == ids_theirs
    edit_config(tmp_path, quantization_config={"quant_method": "compressed-tensors"})
    with pytest.raises(CheckpointError, match="quantization_config"):
        load_model(tmp_path)


def test_the_real_model_shapes():
    preset = ARCHITECTURE.presets[0]
    c = parse_config(CheckpointConfig(preset.name, {"model_type": "gemma4_text", "num_hidden_layers": 30,
                                                    **preset.config}))
    full = [i for i, kind in enumerate(c.layer_types) if kind == "full_attention"]
    assert full == [5, 11, 17, 23, 29]  # transformers' default pattern: 5 sliding, then a full one
    assert {c.head_dims[i] for i in full} == {512} and {c.kv_heads[i] for i in full} == {2}
    assert c.head_dims[0] == 256 and c.kv_heads[0] == 8 and c.sliding_window == 1024
    assert c.kv_cache_layout == KVCacheLayout(num_kv_heads=8, k_dim=256, v_dim=256) and c.kv_cache_channels == 2048
    layer = ARCHITECTURE.layer_preset(preset)
    assert (layer.hidden, layer.inter, layer.experts, layer.top_k, layer.shared_inter, layer.activation) == (
        2816, 704, 128, 8, 2112, "gelu_tanh")


def test_rope_frequencies_are_transformers():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding
    preset = ARCHITECTURE.presets[0].config
    config = transformers.Gemma4TextConfig(**{**preset, "num_hidden_layers": 6})
    theirs = Gemma4TextRotaryEmbedding(config)
    c = parse_config(CheckpointConfig("gemma", {"model_type": "gemma4_text", "num_hidden_layers": 6, **preset}))
    for kind, head_dim in (("sliding_attention", 256), ("full_attention", 512)):
        assert torch.equal(rope_inv_freq(head_dim, c.rope[kind]), getattr(theirs, f"{kind}_inv_freq")), kind
    assert int((rope_inv_freq(512, c.rope["full_attention"]) > 0).sum()) == 64  # a quarter of the 256 pairs
    assert torch.equal(rope_inv_freq(8, RopeSpec("proportional", 100.0, 0.5, 2.0)),
                       torch.tensor([1.0, 100 ** -0.25, 0, 0]) / 2)


def test_config_defaults_as_transformers():
    text = {"model_type": "gemma4_text", **BASE, "head_dim": 64, "num_key_value_heads": 8}  # room for a 512 head
    del text["layer_types"], text["global_head_dim"]
    c = parse_config(CheckpointConfig("gemma", {**text, "num_hidden_layers": 7}))
    assert c.layer_types == ["sliding_attention"] * 5 + ["full_attention"] * 2  # the last layer is always full
    assert c.head_dims[5] == 512 and c.kv_heads[5] == 1  # global_head_dim's default
    c = parse_config(CheckpointConfig("gemma", {"model_type": "gemma4_text", **BASE, "attention_k_eq_v": False}))
    assert c.kv_heads == [4, 4, 4] and c.head_dims == [16, 16, 32]  # num_global_key_value_heads: with k = v only
    assert c.kv_cache_layout == KVCacheLayout(num_kv_heads=4, k_dim=32, v_dim=32)
    c = parse_config(CheckpointConfig("gemma", {"model_type": "gemma4_text", **BASE,
                                                "layer_types": ["sliding_attention"] * 3}))
    assert c.layer_types[-1] == "full_attention"


def rope(**full):
    return {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, **full}}


REFUSED = {
    "per-layer-inputs": (dict(hidden_size_per_layer_input=256), "hidden_size_per_layer_input"),
    "kv-sharing": (dict(num_kv_shared_layers=1), "num_kv_shared_layers"),
    "bidirectional": (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    "dense": (dict(enable_moe_block=False), "enable_moe_block"),
    "silu": (dict(hidden_activation="silu"), "hidden_activation"),
    "zero-cap": (dict(final_logit_softcapping=0.0), "final_logit_softcapping"),
    "yarn": (dict(rope_parameters=rope(rope_type="yarn", factor=4.0)), "rope_type 'yarn'"),
    "partial-default": (dict(rope_parameters={**rope(), "sliding_attention": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}), "partial_rotary_factor"),
    "no-theta": (dict(rope_parameters=rope(rope_theta=None)), "rope_theta"),
    "per-layer-override": (dict(per_layer_config={"2": {"intermediate_size": 8}}), "per_layer_config"),
    "layer-types": (dict(layer_types=["full_attention"] * 2), "layer_types"),
    "cache-misfit": (dict(global_head_dim=48), "do not fit the cache"),
    "kv-heads": (dict(num_global_key_value_heads=3), "KV heads must divide"),
    "top-k": (dict(top_k_experts=9), "top_k_experts"),
}


@pytest.mark.parametrize("change, words", list(REFUSED.values()), ids=list(REFUSED))
def test_unsupported_config_values_are_refused(change, words):
    with pytest.raises(CheckpointError, match=words):
        parse_config(CheckpointConfig("gemma", {"model_type": "gemma4_text", **BASE, **change}))


def test_refusals_without_the_key():
    """hidden_size_per_layer_input defaults to 256 in transformers: a config.json without it has per-layer inputs;
    a gemma4 config.json without text_config has no text model."""
    config = {"model_type": "gemma4_text", **BASE}
    config.pop("hidden_size_per_layer_input")
    with pytest.raises(CheckpointError, match="hidden_size_per_layer_input"):
        parse_config(CheckpointConfig("gemma", config))
    with pytest.raises(CheckpointError, match="text_config"):
        parse_config(CheckpointConfig("gemma", {"model_type": "gemma4"}))
    text = parse_config(CheckpointConfig("gemma", {"model_type": "gemma4", "text_config": BASE,
                                                   "tie_word_embeddings": False}))
    assert not text.tie_word_embeddings  # the whole checkpoint's value
