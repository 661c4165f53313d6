"""Mixtral, OLMoE and Qwen2-MoE (the shared MoE decoder, moe_decoder.py) against transformers, beyond what the
conformance test checks for every architecture: config variants (tied embeddings, clip_qkv, biases, sparse steps,
RoPE scalings), which modules each layer gets, the make-model checkpoints, and refusals. Qwen3-MoE has its own
file, test_qwen3_moe.py.

Tolerances, as max |ours - theirs| / max |theirs| over the logits: fp32 1e-4.
"""
import json
from dataclasses import dataclass

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cpumoe.loader import CheckpointError  # noqa: E402
from cpumoe.models import ARCHITECTURES, load_model  # noqa: E402
from cpumoe.models.blocks import MoEBlock  # noqa: E402
from tests.models.tiny import rel_err, spread_weights_  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
PROMPT = [111, 87, 25, 71, 115, 92, 74, 62, 46, 32, 88]
_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               num_experts_per_tok=2, rope_theta=1e4)


@dataclass(frozen=True)
class Arch:
    model_type: str
    hf: str  # transformers class prefix: {hf}Config, {hf}ForCausalLM
    config: dict
    # chosen so that no token's 2nd and 3rd expert nearly tie in bf16 (see min_router_margin): a near tie lets
    # bf16 rounding pick a different expert, and one rerouted token moves the logits by ~10%.
    prompt: tuple[int, ...] = tuple(PROMPT)

    @property
    def ids(self) -> torch.Tensor:  # [1, T]
        return torch.tensor([self.prompt])

    def tiny_model(self, dtype=torch.float32, **overrides):
        torch.manual_seed(0)
        config = getattr(transformers, f"{self.hf}Config")(**{**_COMMON, **self.config, **overrides})
        model = getattr(transformers, f"{self.hf}ForCausalLM")(config)
        return spread_weights_(model).to(dtype).eval()


ARCHS = {a.model_type: a for a in [
    Arch("mixtral", "Mixtral", dict(intermediate_size=32, num_local_experts=8),
         prompt=(16, 120, 67, 14, 27, 120, 55, 24, 44, 47, 21)),
    Arch("olmoe", "Olmoe", dict(intermediate_size=32, num_experts=8),
         prompt=(88, 111, 17, 57, 61, 114, 46, 85, 114, 34, 82)),
    Arch("qwen2_moe", "Qwen2Moe", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                       shared_expert_intermediate_size=48, mlp_only_layers=[1]),
         prompt=(103, 118, 122, 84, 22, 3, 49, 126, 59, 125, 87)),
]}


def save(model, path, **kw):
    model.save_pretrained(path, **kw)
    return path


@pytest.mark.parametrize("model_type, variant", [
    ("mixtral", dict(tie_word_embeddings=True)),
    ("olmoe", dict(clip_qkv=0.5)),  # x5 weights: most q/k/v entries exceed 0.5, so clipping matters
    ("olmoe", dict(norm_topk_prob=True, attention_bias=True)),
    ("qwen2_moe", dict(norm_topk_prob=True, qkv_bias=False)),
    ("qwen2_moe", dict(decoder_sparse_step=2, mlp_only_layers=[])),
], ids=["mixtral-tied", "olmoe-clip-qkv", "olmoe-renorm-bias", "qwen2_moe-renorm-no-bias", "qwen2_moe-sparse-step-2"])
def test_config_variants(model_type, variant, tmp_path):
    arch = ARCHS[model_type]
    theirs_model = arch.tiny_model(**variant)
    ours = load_model(save(theirs_model, tmp_path))
    with torch.no_grad():
        theirs = theirs_model(arch.ids).logits
    err = rel_err(ours(arch.ids), theirs)
    assert err <= TOL[torch.float32], f"{model_type} {variant}: rel err {err:.2e}"


def test_qwen2_moe_layers_follow_config(tmp_path):
    ours = load_model(save(ARCHS["qwen2_moe"].tiny_model(), tmp_path))
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers]
    assert kinds == ["MoEBlock", "GatedMLP", "MoEBlock"]
    assert ours.model.layers[0].mlp.shared_expert is not None and not ours.model.layers[0].mlp.renormalize
    assert ours.model.layers[0].self_attn.q_proj.bias is not None and ours.model.layers[0].self_attn.o_proj.bias is None


def test_mixtral_block_and_routing(tmp_path):
    ours = load_model(save(ARCHS["mixtral"].tiny_model(), tmp_path))
    block = ours.model.layers[0].block_sparse_moe
    assert isinstance(block, MoEBlock) and block.renormalize and block.shared_expert is None
    assert not hasattr(ours.model.layers[0], "mlp")


@pytest.mark.parametrize("model_type, edit", [
    ("mixtral", dict(sliding_window=4096)),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=16)),
], ids=["mixtral-sliding-window", "qwen2_moe-use-sliding-window"])
def test_sliding_window_is_refused(model_type, edit, tmp_path):
    path = save(ARCHS[model_type].tiny_model(), tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    config.update(edit)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="sliding-window attention .* not supported yet"):
        load_model(path)


def test_qwen3_moe_attention_bias(tmp_path):
    """Qwen3-MoE's attention_bias puts biases on q, k, v and o (o was missed before the shared decoder)."""
    from tests.models.test_qwen3_moe import PROMPT as QWEN3_PROMPT, tiny_model

    theirs_model = tiny_model(attention_bias=True)
    with torch.no_grad():
        for name, p in theirs_model.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0.0, 0.5)  # transformers zero-inits biases
        theirs = theirs_model(QWEN3_PROMPT).logits
    ours = load_model(save(theirs_model, tmp_path))
    assert ours.model.layers[0].self_attn.o_proj.bias is not None
    assert rel_err(ours(QWEN3_PROMPT), theirs) <= TOL[torch.float32]


@pytest.mark.parametrize("preset", [arch.presets[0].name for arch in ARCHITECTURES.values()])
def test_synthetic_checkpoint_matches(preset, tmp_path):
    """`cpumoe make-model`'s checkpoint (hub names, locally trained tokenizer) loads in both and agrees."""
    from cpumoe.synthetic.checkpoint import make_checkpoint, tiny_overrides

    path = make_checkpoint(preset, tmp_path / "ckpt", layers=2, vocab=300, dtype=torch.float32,
                           overrides=tiny_overrides(preset))
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(path)("Mixture of experts on CPUs", return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = theirs_model(ids).logits.float()
        ours = load_model(path)(ids)
    assert rel_err(ours, theirs) <= TOL[torch.float32], f"{preset}: rel err {rel_err(ours, theirs):.2e}"


# RoPE scaling through the shared decoder's Attention (rope.py). A short original_max_position_embeddings puts most
# of the tiny head_dim's frequencies inside yarn's interpolated range at these prompt lengths.
ROPE_VARIANTS = {
    "qwen3_moe-yarn": ("qwen3_moe", dict(max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4})),
    "qwen3_moe-yarn-no-truncate-attention-factor": ("qwen3_moe", dict(max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "beta_fast": 8.0,
        "beta_slow": 2.0, "truncate": False, "attention_factor": 1.3, "rope_theta": 1e4})),
    "mixtral-linear": ("mixtral", dict(rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4})),
    "olmoe-llama3": ("olmoe", dict(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 1e4})),
}


def _rope_variant_model(name):
    model_type, overrides = ROPE_VARIANTS[name]
    if model_type == "qwen3_moe":
        from tests.models.test_qwen3_moe import PROMPT as QWEN3_PROMPT, tiny_model
        return tiny_model(**overrides), QWEN3_PROMPT, tiny_model()
    arch = ARCHS[model_type]
    return arch.tiny_model(**overrides), arch.ids, arch.tiny_model()


@pytest.mark.parametrize("name", list(ROPE_VARIANTS))
def test_rope_scaling_matches(name, tmp_path):
    """Prefill logits (fp32) and engine greedy tokens, whole prompt and chunked prefill, under a scaled RoPE; and the
    scaling does change the logits (against the same weights with default RoPE)."""
    theirs_model, ids, default_model = _rope_variant_model(name)
    path = save(theirs_model, tmp_path)
    ours = load_model(path)
    kind = ROPE_VARIANTS[name][1]["rope_parameters"]["rope_type"]
    assert ours.model.layers[0].self_attn.rotary.scaling["rope_type"] == kind
    with torch.no_grad():
        theirs = theirs_model(ids).logits
        unscaled = default_model(ids).logits
    err = rel_err(ours(ids), theirs)
    assert err <= TOL[torch.float32], f"{name}: rel err {err:.2e}"
    assert rel_err(unscaled, theirs) > 100 * TOL[torch.float32], f"{name}: the scaling changes nothing here"
    with torch.no_grad():
        ref = theirs_model.generate(ids, do_sample=False, max_new_tokens=8, min_new_tokens=8)[0, ids.shape[1]:]
    for budget in (512, 4):
        engine = LLMEngine(path, config=EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=budget))
        out = engine.generate([ids[0].tolist()], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
        assert out.new_token_ids == ref.tolist(), f"{name}, token budget {budget}"


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                                  {"rope_type": "longrope", "factor": 2.0, "rope_theta": 1e4}],
                         ids=["dynamic", "longrope"])
def test_unsupported_rope_is_refused(rope, tmp_path):
    path = save(ARCHS["mixtral"].tiny_model(), tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = rope
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"rope type '{rope['rope_type']}' is not supported; supported: "):
        load_model(path)
