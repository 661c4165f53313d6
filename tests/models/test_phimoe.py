"""Phi-3.5-MoE beyond the conformance test (tests/models/test_conformance.py runs its tiny config: longrope, a
sliding window shorter than the prompt, q/k/v/o and lm_head biases, LayerNorms, sparsemixer with a wide margin):
sparsemixer against transformers' own function, the rotary against transformers' at positions past
original_max_position_embeddings, config variants (default RoPE, no biases, the published config.json's layout)
against PhimoeForCausalLM, the engine over a window that ends inside cache blocks, the preset, and the config values
cpumoe refuses.

Tolerance, as max |ours - theirs| / max |theirs| over the logits: fp32 1e-4.
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
modeling_phimoe = pytest.importorskip("transformers.models.phimoe.modeling_phimoe")

from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cpumoe.loader import CheckpointConfig, CheckpointError  # noqa: E402
from cpumoe.models import load_model  # noqa: E402
from cpumoe.models.phimoe import ARCHITECTURE, long_rope, parse_config, sparsemixer  # noqa: E402
from tests.models.tiny import greedy_without_cache, rel_err, spread_weights_  # noqa: E402

TOL = 1e-4
PROMPT = torch.tensor([[111, 87, 25, 71, 115, 92, 74, 62, 46, 32, 88, 17, 5]])  # [1, T]
BASE = {**ARCHITECTURE.presets[0].config, "num_hidden_layers": 3, **ARCHITECTURE.tiny, "vocab_size": 128,
        "eos_token_id": None, "pad_token_id": None, "bos_token_id": None}  # no eos: generate runs its length


def tiny_model(**overrides):
    torch.manual_seed(0)
    model = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(**{**BASE, **overrides}))
    model.set_experts_implementation("eager")
    return spread_weights_(model).float().eval()


def generate(model, ids, tokens=10) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens)  # [1, T + tokens]
    return out[0, ids.shape[1]:].tolist()


# --- sparsemixer ------------------------------------------------------------------------------------------------

def routing_logits(dtype: torch.dtype) -> torch.Tensor:
    """[M, 16] logits with what moves sparsemixer: near ties at both picks, all-negative rows, exact ties, spreads
    from flat to sharp."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(64, 16, generator=g) * scale for scale in (0.05, 0.5, 1.0, 4.0)]
    rows.append(-torch.rand(16, 16, generator=g) - 1.0)  # every logit negative: max(|s|, m) is |s|
    near = torch.randn(16, 16, generator=g)
    near[:, 3] = near.max(dim=-1).values * 1.01  # the runner-up within 1% of the best
    rows.append(near)
    tied = torch.randn(8, 16, generator=g)
    tied[:, 5] = tied[:, 9] = tied.max(dim=-1).values + 1.0  # an exact tie for the first pick
    rows.append(tied)
    return torch.cat(rows).to(dtype)


@pytest.mark.parametrize("jitter_eps", [0.0, 0.01, 0.1, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparsemixer_equals_transformers(dtype, jitter_eps):
    logits = routing_logits(dtype)
    weights, ids = sparsemixer(logits, jitter_eps)
    their_weights, their_ids = modeling_phimoe.sparsemixer(logits, jitter_eps=jitter_eps, training=False)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (len(logits), 2)
    assert torch.equal(ids.long(), their_ids)
    assert torch.equal(weights, their_weights.float())  # bit for bit: the same ops in the same dtype


def test_sparsemixer_weights():
    """Two experts a token, the best first; a weight is 1 when no other logit is within the margin, and the two
    weights are not renormalized."""
    logits = torch.tensor([[4.0, 1.0, 0.0, 2.0],     # far apart: both weights 1
                           [4.0, 3.95, 0.0, 1.0],    # the runner-up within 2 * eps of the best: they share
                           [-1.0, -2.0, -1.01, -5.0]])
    weights, ids = sparsemixer(logits, jitter_eps=0.01)
    assert ids.tolist() == [[0, 3], [0, 1], [0, 2]]
    assert weights[0].tolist() == [1.0, 1.0]
    assert weights[1, 0] == pytest.approx(torch.tensor([4.0, 3.95]).softmax(0)[0].item())
    assert weights[1, 1] == 1.0  # without the first expert, nothing is near 3.95
    assert weights[2, 0] == pytest.approx(torch.tensor([-1.0, -1.01]).softmax(0)[0].item())
    assert weights[2, 1] == 1.0


# --- rotary -----------------------------------------------------------------------------------------------------

def test_longrope_cos_sin_equal_transformers_past_the_original_length():
    """transformers' Phimoe rotary uses the short factors at every length (and long_mscale past
    original_max_position_embeddings, equal to short_mscale here): ours agrees bit for bit on both sides of it."""
    config = transformers.PhimoeConfig(**BASE)
    theirs = modeling_phimoe.PhimoeRotaryEmbedding(config)
    parsed = parse_config(CheckpointConfig("tiny", {"model_type": "phimoe", **config.to_dict()}))
    ours = long_rope(parsed.head_dim, parsed.rope_theta, parsed.rope_scaling)
    positions = torch.arange(40)  # original_max_position_embeddings 16
    x = torch.zeros(1, dtype=torch.float32)
    for span in (positions[:12], positions):  # the short branch, and the long one
        cos, sin = theirs(x, span[None])
        assert torch.equal(ours(span, torch.float32)[0], cos[0]) and torch.equal(ours(span, torch.float32)[1], sin[0])


# --- whole model ------------------------------------------------------------------------------------------------

VARIANTS = {
    # default RoPE with theta from transformers' default (1e6), full attention, no biases anywhere
    "plain": dict(rope_parameters=None, sliding_window=None, attention_bias=False, lm_head_bias=False),
    "published-jitter": dict(router_jitter_noise=0.01),  # sparsemixer weights mostly 1
    "no-jitter": dict(router_jitter_noise=0.0),
    "window-longer-than-prompt": dict(sliding_window=64),
    "mha": dict(num_key_value_heads=4),
}


@pytest.mark.parametrize("overrides", list(VARIANTS.values()), ids=list(VARIANTS))
def test_config_variants_match_transformers(overrides, tmp_path):
    model = tiny_model(**overrides)
    model.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    with torch.no_grad():
        theirs = model(PROMPT).logits
    assert rel_err(ours(PROMPT), theirs) <= TOL
    ids_ours, ids_theirs = greedy_without_cache(ours, model, PROMPT, steps=6)  # past original_max (16)
    assert ids_ours == ids_theirs


def test_published_config_layout(tmp_path):
    """The hub's config.json keeps the rope dict under rope_scaling ("type": "longrope") with rope_theta and
    original_max_position_embeddings at the top level: read as transformers reads it."""
    model = tiny_model()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope.pop("rope_type")
    config["rope_scaling"] = {**rope, "type": "longrope"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    parsed = parse_config(CheckpointConfig(tmp_path))
    assert parsed.rope_theta == 10000.0
    assert parsed.rope_scaling["short_factor"] == BASE["rope_parameters"]["short_factor"]
    theirs_model = transformers.PhimoeForCausalLM.from_pretrained(tmp_path).float().eval()
    with torch.no_grad():
        theirs = theirs_model(PROMPT).logits
    assert rel_err(load_model(tmp_path)(PROMPT), theirs) <= TOL


@pytest.mark.parametrize("engine", [dict(max_num_batched_tokens=512), dict(max_num_batched_tokens=5),
                                    dict(max_num_batched_tokens=512, batch_invariant=True)],
                         ids=["whole-prompt", "chunks-of-5", "batch-invariant"])
def test_engine_with_a_window_across_cache_blocks(engine, tmp_path):
    """A 6-token window over 4-token cache blocks: decodes start their keys inside a block. Two requests of
    different lengths at once, each running past original_max_position_embeddings."""
    model = tiny_model(sliding_window=6)
    model.save_pretrained(tmp_path)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :7].tolist()]
    refs = [generate(model, torch.tensor([p])) for p in prompts]
    llm = LLMEngine(tmp_path, config=EngineConfig(block_size=4, num_blocks=64, **engine))
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [out.new_token_ids for out in outs] == refs


# --- preset -----------------------------------------------------------------------------------------------------

def test_preset():
    preset = ARCHITECTURE.presets[0]
    assert preset.name == "phi-3.5-moe"
    layer = ARCHITECTURE.layer_preset(preset)
    assert (layer.hidden, layer.inter, layer.experts, layer.top_k, layer.shared_experts) == (4096, 6400, 16, 2, 0)
    assert (layer.activation, layer.scoring, layer.renormalize) == ("silu", "sparsemixer", False)
    config = ARCHITECTURE.preset_config(preset)
    assert (config.head_dim, config.num_key_value_heads, config.sliding_window) == (128, 8, 131072)
    assert config.attention_bias and config.lm_head_bias and config.rope_theta == 10000.0
    assert config.rope_scaling["short_mscale"] == pytest.approx(1.243163121016122)
    with pytest.raises(ValueError, match="2 experts"):
        ARCHITECTURE.layer_shape_config(hidden=2048, inter=1024, experts=8, top_k=4)


def test_defaults_are_transformers():
    """What config.json leaves out reads as PhimoeConfig's defaults: theta 1e6, 8 key-value heads, jitter 0.01,
    no biases, no window."""
    left_out = ("rope_parameters", "num_key_value_heads", "router_jitter_noise", "sliding_window", "attention_bias",
                "lm_head_bias", "head_dim", "original_max_position_embeddings")
    config = {k: v for k, v in BASE.items() if k not in left_out}
    parsed = ARCHITECTURE.config(CheckpointConfig("tiny", {"model_type": "phimoe", **config}))
    theirs = transformers.PhimoeConfig(**config)
    assert parsed.rope_theta == theirs.rope_parameters["rope_theta"] == 1e6 and parsed.rope_scaling is None
    assert parsed.num_key_value_heads == theirs.num_key_value_heads == 8
    assert parsed.router_jitter_noise == theirs.router_jitter_noise == 0.01
    assert (parsed.attention_bias, parsed.lm_head_bias, parsed.sliding_window) == (False, False, None)


# --- refusals ---------------------------------------------------------------------------------------------------

def _rope(**changes) -> dict:
    return {"rope_parameters": {**BASE["rope_parameters"], **changes}}


REFUSED = {
    "hidden_act": dict(hidden_act="gelu"),
    "num_experts_per_tok": dict(num_experts_per_tok=4),
    "num_local_experts": dict(num_local_experts=1, num_experts_per_tok=2),
    "router_jitter_noise": dict(router_jitter_noise=-0.01),
    "sliding_window": dict(sliding_window=0),
    "lm_head_bias": dict(tie_word_embeddings=True, lm_head_bias=True),
    "rope type": _rope(rope_type="yarn"),
    "short_factor": _rope(short_factor=[1.0] * 7),
    "long_factor": {"rope_parameters": {k: v for k, v in BASE["rope_parameters"].items() if k != "long_factor"}},
    "short_mscale": _rope(short_mscale=None),
    "long_mscale": _rope(long_mscale=1.0),
    "partial_rotary_factor": _rope(partial_rotary_factor=0.5),
    "nested": {"rope_parameters": {"full_attention": dict(BASE["rope_parameters"])}},
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_refused(field):
    config = {"model_type": "phimoe", **BASE, **REFUSED[field]}
    match = {"rope type": "type 'yarn'", "nested": "nested", "lm_head_bias": "lm_head_bias"}.get(field, field)
    with pytest.raises(CheckpointError, match=match):
        ARCHITECTURE.config(CheckpointConfig("tiny", config))
