"""GLM-4.5 / 4.6 (glm4_moe) against transformers, beyond the conformance test's one tiny config: variants of the
router (groups or one group, renormalized or not, scaled or not), of the partial rotary (a quarter, a half, all of
each head; yarn-scaled; the factor at config.json's top level as the published checkpoints have it), without q/k
norm or biases, with tied embeddings; each with a random e_score_correction_bias (transformers initializes it to zeros)
that, like the grouping, changes the experts some tokens get, and no routing decision a near-tie. Then the float32
router of a bf16 checkpoint, the batch-invariant engine, a batch of two, the multi-token-prediction layer left
unread, a block-FP8 checkpoint, how config.json is read (where the rotary factor comes from) and what is refused.

Tolerance: max |ours - theirs| / max |theirs| over the logits <= 1e-4 in fp32; in bf16 2e-2, or twice transformers'
own bf16 error against its fp32 where that is larger.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cpumoe.loader import Checkpoint, CheckpointConfig, CheckpointError  # noqa: E402
from cpumoe.models import load_model  # noqa: E402
from cpumoe.models.blocks import GatedMLP  # noqa: E402
from cpumoe.models.deepseek_v3 import DeepseekV3MoE  # noqa: E402
from cpumoe.models.glm4_moe import ARCHITECTURE, PartialRotaryAttention  # noqa: E402
from tests.models.tiny import (choose, engine_greedy, generate_reference, greedy_without_cache, prefill_error,
                               rel_err, routers, spread_weights_)  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
PROMPT = torch.tensor([[111, 87, 25, 71, 115, 92, 74, 62, 46, 32, 88]])  # [1, T]
BIAS_STD = 0.1  # scores are sigmoids in ~[0.1, 0.9]: a bias of this size reorders some of them
BASE = dict(ARCHITECTURE.tiny, vocab_size=128, num_hidden_layers=3, attn_implementation="eager",
            eos_token_id=None, pad_token_id=None, bos_token_id=None)  # no eos: generate runs its full length


def rope(partial_rotary_factor, **scaling):
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor, **scaling}


VARIANTS = {
    # the tiny config: 4 groups of 2 experts, 2 kept, top-2, renormalized, x 2.5; half of each head rotated
    "groups": dict(),
    # the published routing: one group; 16 experts, top-4, not renormalized, two shared experts; every channel
    # of each head rotated
    "one-group-full-rotary": dict(n_group=1, topk_group=1, n_routed_experts=16, num_experts_per_tok=4,
                                  norm_topk_prob=False, routed_scaling_factor=1.0, n_shared_experts=2,
                                  rope_parameters=rope(1.0)),
    # a quarter of head_dim = hidden / heads = 16 rotated; no q/k norm, no biases, two dense layers, tied embeddings
    "quarter-rotary-plain": dict(head_dim=None, rope_parameters=rope(0.25), use_qk_norm=False, attention_bias=False,
                                 first_k_dense_replace=2, tie_word_embeddings=True),
    # half of each head rotated, yarn-scaled (its frequencies over the rotary channels, as transformers')
    "half-rotary-yarn": dict(rope_parameters=rope(0.5, rope_type="yarn", factor=4.0,
                                                  original_max_position_embeddings=64)),
    # config.json as the published checkpoints write it: rope_theta and partial_rotary_factor at the top level
    "published-form": dict(rope_parameters=rope(0.25)),
}
PUBLISHED_FORM = {"published-form"}


def tiny_model(dtype=torch.float32, **overrides):
    values = {**BASE, **overrides}
    if values.get("head_dim", 0) is None:  # transformers then takes hidden / heads
        del values["head_dim"]
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**values))
    model.set_experts_implementation("eager")  # the plain per-expert loop, not grouped_mm
    assert model.config._attn_implementation == "eager"
    spread_weights_(model).float().eval()
    with torch.no_grad():
        for layer in model.model.layers[model.config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, BIAS_STD)
    if dtype != torch.float32:
        routers = {name: t.clone() for name, t in model.state_dict().items() if ".mlp.gate." in name}
        model.to(dtype).load_state_dict(routers, strict=False, assign=True)  # float32, as from_pretrained keeps them
    return model


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def save(model, path, published_form=False):
    model.save_pretrained(path)
    if published_form:
        config = json.loads((path / "config.json").read_text())
        rope_parameters = config.pop("rope_parameters")
        config.update(rope_scaling=None, rope_theta=rope_parameters["rope_theta"],
                      partial_rotary_factor=rope_parameters["partial_rotary_factor"])
        (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request, tmp_path_factory):
    model = tiny_model(**VARIANTS[request.param])
    path = save(model, tmp_path_factory.mktemp(f"glm4_moe_{request.param}"), request.param in PUBLISHED_FORM)
    return request.param, model, path


def test_layers_assembled_as_the_config_says(pair):
    name, model, path = pair
    c = model.config
    ours = load_model(path)
    first = c.first_k_dense_replace
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP] * first + [DeepseekV3MoE] * (3 - first)
    moe, attention = ours.model.layers[first].mlp, ours.model.layers[0].self_attn
    grouped = c.n_group > 1
    assert moe.routing == dict(scoring="sigmoid", num_expert_group=c.n_group if grouped else None,
                               topk_group=c.topk_group if grouped else None,
                               routed_scaling_factor=c.routed_scaling_factor), name
    assert moe.renormalize == c.norm_topk_prob and moe.top_k == c.num_experts_per_tok
    assert moe.shared_experts.gate_proj.out_features == c.moe_intermediate_size * c.n_shared_experts
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    assert isinstance(attention, PartialRotaryAttention) and attention.head_dim == head_dim
    assert attention.rotary_dim == int(head_dim * c.rope_parameters["partial_rotary_factor"]), name
    assert (attention.q_norm is not None) == c.use_qk_norm
    q_proj = attention.qkv_proj or attention.q_proj  # joined with k and v where their packing allows
    assert (q_proj.bias is not None) == c.attention_bias and attention.o_proj.bias is None
    assert (ours.lm_head is None) == c.tie_word_embeddings
    torch.testing.assert_close(moe.gate.e_score_correction_bias,
                               model.model.layers[first].mlp.gate.e_score_correction_bias, rtol=0, atol=0)


def test_bias_and_grouping_change_the_choice_and_no_near_ties(pair):
    """The variant is a real test of the router: without the bias (and, with groups, without the grouping) some
    token gets other experts; and the reference's decisions are not near-ties (fp32 noise is ~1e-6)."""
    name, model, _ = pair
    c = model.config
    bias_moves = group_moves = 0
    for logits, bias in routers(model, PROMPT):
        ids, margin = choose(logits, bias, c)
        assert margin > 1e-4, f"{name}: routing near-tie ({margin:.1e}): the prompt no longer suits this test"
        bias_moves += (choose(logits, torch.zeros_like(bias), c)[0] != ids).any(-1).sum().item()
        group_moves += (choose(logits, bias, c, grouped=False)[0] != ids).any(-1).sum().item()
    assert bias_moves > 0, f"{name}: the bias moves no token"
    assert group_moves > 0 or c.n_group == 1, f"{name}: the grouping moves no token"


def test_prefill_logits_match(pair):
    name, model, path = pair
    err = prefill_error(path, model, PROMPT)
    assert err <= TOL[torch.float32], f"{name}: max abs diff / max |logit| = {err:.2e} > {TOL[torch.float32]:.0e}"


def test_greedy_decode_matches(pair):
    name, model, path = pair
    ours, theirs = greedy_without_cache(load_model(path), model, PROMPT)
    assert ours == theirs, name


@pytest.mark.parametrize("budget", [512, 4], ids=["whole-prompt", "chunks-of-4"])
def test_engine_greedy_matches_generate(pair, budget):
    name, model, path = pair
    ref = generate_reference(model, PROMPT)
    assert engine_greedy(path, [PROMPT[0].tolist()], budget=budget) == [ref], f"{name}, budget {budget}"


@pytest.mark.parametrize("budget", [512, 4], ids=["whole-prompt", "chunks-of-4"])
def test_batch_invariant_engine_matches_generate(tmp_path, budget):
    """The batch-invariant engine runs the partial-rotary attention on row_attention."""
    model = tiny_model()
    path = save(model, tmp_path)
    with torch.no_grad():
        ref = model.generate(PROMPT, do_sample=False, max_new_tokens=8)[0, PROMPT.shape[1]:]
    config = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=budget, batch_invariant=True)
    out = LLMEngine(path, config=config).generate([PROMPT[0].tolist()],
                                                  SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out[0].new_token_ids == ref.tolist()


@pytest.mark.parametrize("budget", [512, 4], ids=["whole-prompt", "chunks-of-4"])
def test_engine_batch_of_two_matches_single(tmp_path, budget):
    """Two sequences of different lengths in one batch: the paged cache keeps them apart."""
    path = save(tiny_model(**VARIANTS["one-group-full-rotary"]), tmp_path)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :5].tolist()]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    config = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=budget)  # 4: decodes beside chunks
    together = [o.new_token_ids for o in LLMEngine(path, config=config).generate(prompts, params)]
    alone = [LLMEngine(path, config=config).generate([p], params)[0].new_token_ids for p in prompts]
    assert together == alone


def test_bf16_router_stays_float32(tmp_path):
    """In a bf16 checkpoint the router weight and correction bias are float32 (transformers keeps them so); cpumoe
    keeps them float32 too, and its logits match within the bf16 tolerance."""
    fp32, bf16 = tiny_model(), tiny_model(torch.bfloat16)
    ckpt = Checkpoint(save(bf16, tmp_path))
    assert ckpt.dtype("model.layers.1.mlp.gate.e_score_correction_bias") == torch.float32
    assert ckpt.dtype("model.layers.1.mlp.gate.weight") == torch.float32
    ours = load_model(tmp_path)
    gate = ours.model.layers[1].mlp.gate
    assert (ours.model.embed_tokens.weight.dtype, gate.weight.dtype, gate.e_score_correction_bias.dtype) == \
        (torch.bfloat16, torch.float32, torch.float32)
    with torch.no_grad():
        theirs = bf16(PROMPT).logits.float()
        own_err = rel_err(theirs, fp32(PROMPT).logits)
    err = rel_err(ours(PROMPT), theirs)
    assert err <= max(TOL[torch.bfloat16], 2 * own_err), f"bf16: {err:.2e}; transformers' own: {own_err:.2e}"


def test_multi_token_prediction_layer_is_not_read(tmp_path):
    """The published checkpoints carry num_nextn_predict_layers = 1 extra layer (model.layers.{N}); transformers
    does not read it, nor does cpumoe."""
    model = tiny_model()
    path = save(model, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors.update({name.replace("model.layers.2.", "model.layers.3."): t.clone()
                    for name, t in tensors.items() if name.startswith("model.layers.2.")})
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    ours = load_model(path)
    assert len(ours.model.layers) == 3
    with torch.no_grad():
        theirs = model(PROMPT).logits
    assert rel_err(ours(PROMPT), theirs) <= TOL[torch.float32]


def test_block_fp8_checkpoint_matches_its_dequantized_twin(tmp_path):
    """Block FP8 (the format of the published -FP8 checkpoints' kind): the projections and experts run in FP8; the
    float32 router stays as it is."""
    from cpumoe.loader.quantized.convert import quantize_checkpoint
    from cpumoe.models.packed_linear import QuantizedLinear
    from tests.models.test_quantized_models import dequantized_twin
    save(tiny_model(dtype=torch.bfloat16), tmp_path / "bf16")
    fp8 = quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp8", "fp8", group_size=32).path
    ours = load_model(fp8, dtype=torch.bfloat16)
    attention = ours.model.layers[0].self_attn
    assert isinstance(attention.qkv_proj or attention.q_proj, QuantizedLinear)
    assert all(m.experts.quantization == "fp8_w8a16" for m in ours.modules() if isinstance(m, DeepseekV3MoE))
    assert ours.model.layers[1].mlp.gate.weight.dtype == torch.float32
    twin = load_model(dequantized_twin(tmp_path / "bf16", fp8, tmp_path / "twin"), dtype=torch.bfloat16)
    out, ref = ours(PROMPT)[0], twin(PROMPT)[0]  # [T, V]
    # the same weights, so bf16 rounding only (measured <= 0.7%), except where the two kernels' rounding breaks a
    # routing near-tie differently: that token (one here, in the last layer) moves by ~10%
    per_token = (out - ref).abs().amax(-1) / ref.abs().max()  # [T]
    assert (per_token > 0.03).sum() <= 1, per_token


# config.json values of a small model, read without weights
CONFIG = dict(model_type="glm4_moe", vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
              num_experts_per_tok=2, n_group=4, topk_group=2)


def parse(**changes):
    return ARCHITECTURE.config(CheckpointConfig("glm", {**CONFIG, **changes}))


def test_where_the_rotary_factor_comes_from():
    """As transformers: the rope dict's partial_rotary_factor, else config.json's top-level one, else 0.5
    (Glm4MoeConfig's default); head_dim from the config, else hidden / heads."""
    assert (parse().head_dim, parse().rotary_dim) == (16, 8)
    assert parse(head_dim=32).rotary_dim == 16
    assert parse(partial_rotary_factor=0.25).rotary_dim == 4
    assert parse(partial_rotary_factor=0.25, rope_parameters=rope(1.0)).rotary_dim == 16
    assert parse(partial_rotary_factor=0.25, rope_scaling=None, rope_theta=1e6).rotary_dim == 4
    config = parse(rope_parameters=rope(0.5, rope_type="yarn", factor=4.0, original_max_position_embeddings=64))
    assert config.rope_scaling["rope_type"] == "yarn" and config.rotary_dim == 8


def test_defaults_are_transformers():
    config = parse()
    expected = transformers.Glm4MoeConfig()
    for field in ("n_shared_experts", "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor",
                  "use_qk_norm", "attention_bias", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(expected, field), field
    values = {k: v for k, v in CONFIG.items() if k != "num_key_value_heads"}
    assert ARCHITECTURE.config(CheckpointConfig("glm", values)).num_key_value_heads == expected.num_key_value_heads


@pytest.mark.parametrize("changes, match", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)), "rope type 'dynamic'"),
    (dict(partial_rotary_factor=0.3125), "partial_rotary_factor 0.3125 gives 5 rotary channels"),
    (dict(partial_rotary_factor=0.0), "partial_rotary_factor 0.0 gives 0 rotary channels"),
    (dict(partial_rotary_factor=None), "partial_rotary_factor None gives 0 rotary channels"),
    (dict(n_group=3, topk_group=1), "n_routed_experts 8 must split into n_group 3 groups"),
    (dict(n_group=8, topk_group=2), "n_routed_experts 8 must split into n_group 8 groups of at least 2"),
    (dict(n_group=4, topk_group=5), "topk_group 5 must be in 1..n_group 4"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok 3 must be in 1..2"),
], ids=["gelu", "dynamic-rope", "odd-rotary", "no-rotary", "null-rotary", "groups-indivisible", "group-of-one",
        "topk-group-too-large", "top-k-beyond-kept-groups"])
def test_unsupported_configs_are_refused(changes, match):
    with pytest.raises(CheckpointError, match=match):
        parse(**changes)


def test_refusal_names_the_checkpoint(tmp_path):
    path = edit_config(save(tiny_model(), tmp_path), hidden_act="relu")
    with pytest.raises(CheckpointError, match=f"{tmp_path}.*hidden_act 'relu'"):
        load_model(path)


def test_presets():
    air, full = (ARCHITECTURE.layer_preset(p) for p in ARCHITECTURE.presets)
    assert (air.name, air.hidden, air.inter, air.experts, air.top_k, air.shared_experts, air.shared_inter) == \
        ("glm-4.5-air", 4096, 1408, 128, 8, 1, 1408)
    assert (full.name, full.hidden, full.inter, full.experts, full.top_k, full.shared_experts, full.shared_inter) == \
        ("glm-4.5", 5120, 1536, 160, 8, 1, 1536)
    assert air.scoring == full.scoring == "sigmoid" and air.renormalize and full.renormalize
    for preset in ARCHITECTURE.presets:
        config = ARCHITECTURE.preset_config(preset)
        assert (config.head_dim, config.rotary_dim, config.rope_theta, config.rope_scaling) == (128, 64, 1e6, None)
    assert ARCHITECTURE.preset_config(ARCHITECTURE.presets[1]).use_qk_norm
