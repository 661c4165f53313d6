"""Llama 4 beyond the conformance test (tests/models/test_conformance.py runs its tiny config: chunked RoPE layers,
a NoPE temperature-tuned layer, dense and MoE layers, llama3 RoPE, q/k norm, biases): config variants against
transformers' Llama4ForCausalLM, attention chunks that do not line up with the cache blocks through the engine
(whole, chunked, batch-invariant, speculative), the multimodal checkpoint's language model, and the config values
cpumoe refuses.

Tolerance, as max |ours - theirs| / max |theirs| over the logits: fp32 1e-4.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cpumoe.engine.config import SpeculativeConfig  # noqa: E402
from cpumoe.loader import Checkpoint, CheckpointConfig, CheckpointError  # noqa: E402
from cpumoe.models import CausalLM, load_model  # noqa: E402
from cpumoe.models.blocks import MoEBlock  # noqa: E402
from cpumoe.models.llama4 import ARCHITECTURE, language_model, parse_config  # noqa: E402
from tests.models.tiny import greedy_without_cache, rel_err, spread_weights_  # noqa: E402

TOL = 1e-4
PROMPT = torch.tensor([[111, 87, 25, 71, 115, 92, 74, 62, 46, 32, 88, 17, 5]])  # [1, T]
BASE = {**ARCHITECTURE.presets[0].config, "num_hidden_layers": 3, **ARCHITECTURE.tiny, "vocab_size": 128,
        "eos_token_id": None, "pad_token_id": None, "bos_token_id": None}  # no eos: generate runs its length


def tiny_model(**overrides):
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**{**BASE, **overrides}))
    return spread_weights_(model).float().eval()


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def generate(model, ids, tokens=10) -> list[int]:
    """transformers' greedy tokens after the prompt ids [1, T]."""
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens)  # [1, T + tokens]
    return out[0, ids.shape[1]:].tolist()


VARIANTS = {
    "top-2": dict(num_experts_per_tok=2),  # one kernel call per slot: the kernel scales inputs for one expert
    "maverick-like": dict(use_qk_norm=False, interleave_moe_layer_step=1, no_rope_layers=[1, 1, 0],
                          rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "no-chunks": dict(attention_chunk_size=None),  # every layer attends over the whole context
    "no-temperature": dict(attn_temperature_tuning=False),
    "chunk-6": dict(attention_chunk_size=6),  # chunks that end inside a cache block
    "tied": dict(tie_word_embeddings=True),
}


@pytest.mark.parametrize("overrides", list(VARIANTS.values()), ids=list(VARIANTS))
def test_config_variants_match_transformers(overrides, tmp_path):
    model = tiny_model(**overrides)
    model.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    with torch.no_grad():
        theirs = model(PROMPT).logits
    assert rel_err(ours(PROMPT), theirs) <= TOL
    ids_ours, ids_theirs = greedy_without_cache(ours, model, PROMPT, steps=4)
    assert ids_ours == ids_theirs


@pytest.mark.parametrize("engine", [dict(max_num_batched_tokens=512), dict(max_num_batched_tokens=5),
                                    dict(max_num_batched_tokens=512, batch_invariant=True)],
                         ids=["whole-prompt", "chunks-of-5", "batch-invariant"])
def test_engine_with_chunks_across_cache_blocks(engine, tmp_path):
    """Attention chunks of 6 tokens over 4-token cache blocks: decodes start their keys inside a block, and prefill
    chunks of 5 split where the attention chunks do. Three requests at once, of different lengths: with a budget of
    5, steps mix one request's prefill chunk with the others' decodes."""
    model = tiny_model(attention_chunk_size=6)
    model.save_pretrained(tmp_path)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :7].tolist(), PROMPT[0, 3:12].tolist()]
    refs = [generate(model, torch.tensor([p])) for p in prompts]
    llm = LLMEngine(tmp_path, config=EngineConfig(block_size=4, num_blocks=64, **engine))
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [out.new_token_ids for out in outs] == refs


def test_speculative_verify_steps_across_chunks(tmp_path):
    """n-gram speculation verifies several tokens of a sequence in one step, over cached keys, across attention
    chunks: the greedy tokens stay transformers'."""
    model = tiny_model(attention_chunk_size=6)
    model.save_pretrained(tmp_path)
    prompt = [11, 87, 25, 71, 15, 92, 74, 62, 11, 87, 25, 71, 15, 92, 74]  # repeated: prompt lookup finds drafts
    speculative = SpeculativeConfig.parse(dict(method="ngram", num_speculative_tokens=3))
    llm = LLMEngine(tmp_path, config=EngineConfig(block_size=4, num_blocks=64, speculative=speculative))
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert out.new_token_ids == generate(model, torch.tensor([prompt]), tokens=16)
    assert llm.stats()["verify_steps"] > 0


def test_published_config_values(tmp_path):
    """Published config.json files say attn_temperature_tuning 4 and give no_rope_layers as []; transformers reads
    the first for its truth and fills the second every no_rope_layer_interval layers."""
    model = tiny_model()  # no_rope_layer_interval 2
    model.save_pretrained(tmp_path)
    edit_config(tmp_path, attn_temperature_tuning=4, no_rope_layers=[], layer_types=None, moe_layers=None)
    config = parse_config(CheckpointConfig(tmp_path))
    assert config.rope_layers == [True, False, True] and config.chunked_layers == [True, False, True]
    assert config.moe_layers == {1} and config.attn_temperature_tuning
    with torch.no_grad():
        theirs = model(PROMPT).logits
    assert rel_err(load_model(tmp_path)(PROMPT), theirs) <= TOL


def tiny_multimodal():
    """Llama4ForConditionalGeneration: the tiny text model, and a vision tower of one small layer."""
    torch.manual_seed(0)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = transformers.Llama4Config(text_config=BASE, vision_config=vision)
    return spread_weights_(transformers.Llama4ForConditionalGeneration(config)).float().eval()


def test_multimodal_checkpoint_runs_its_language_model(tmp_path, caplog):
    """model_type llama4 (what meta-llama publishes): the language model under language_model. is loaded, every
    tensor of it read, the vision tower skipped (and logged); text-only prompts give the logits and generations of
    transformers' language model."""
    model = tiny_multimodal()
    model.save_pretrained(tmp_path)
    whole = Checkpoint(tmp_path)
    assert whole.model_type == "llama4" and any(k.startswith("vision_model.") for k in whole.keys())
    text = language_model(whole)
    config = ARCHITECTURE.config(text)
    assert config == ARCHITECTURE.config(whole)  # text_config read alike from the whole config.json
    with torch.device("meta"):
        skeleton = CausalLM(ARCHITECTURE, config)
    experts = {f"{prefix}.{name}" for prefix, block in skeleton.named_modules() if isinstance(block, MoEBlock)
               for name, _ in ARCHITECTURE.expert_tensors(config, block)}
    assert set(text.keys()) == {name for name, _ in skeleton.named_parameters()} | experts

    with caplog.at_level("INFO", logger="cpumoe"):
        ours = load_model(tmp_path)
    assert "vision tower" in caplog.text
    # the reference is its language model: transformers' Llama4ForConditionalGeneration.forward fails without images
    theirs_model = model.language_model
    with torch.no_grad():
        theirs = theirs_model(PROMPT).logits
    assert rel_err(ours(PROMPT), theirs) <= TOL
    llm = LLMEngine(tmp_path, config=EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=4))
    out = llm.generate([PROMPT[0].tolist()], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert out.new_token_ids == generate(theirs_model, PROMPT)


def test_multimodal_checkpoint_context_is_its_language_models(tmp_path):
    """The context the engine checks is text_config's max_position_embeddings, not the top level's."""
    tiny_multimodal().save_pretrained(tmp_path)
    positions = json.loads((tmp_path / "config.json").read_text())["text_config"]["max_position_embeddings"]
    with pytest.raises(ValueError, match=f"max_position_embeddings {positions} "):
        LLMEngine(tmp_path, config=EngineConfig(block_size=4, num_blocks=64, max_model_len=positions + 4))


def test_quantized_multimodal_checkpoint_is_refused(tmp_path):
    tiny_multimodal().save_pretrained(tmp_path)
    edit_config(tmp_path, quantization_config={"quant_method": "fbgemm_fp8"})
    with pytest.raises(CheckpointError, match="quantized multimodal"):
        load_model(tmp_path)


def _config(**changes) -> dict:
    values = transformers.Llama4TextConfig(**BASE).to_dict()
    values.update(changes)
    return {k: v for k, v in values.items() if v is not None or k in changes}


REFUSED = [  # (the field the error names, config.json changes)
    ("hidden_act", dict(hidden_act="gelu")),
    ("layer_types", dict(layer_types=["chunked_attention", "sliding_attention", "full_attention"])),
    ("attention_chunk_size", dict(attention_chunk_size=None)),  # with chunked_attention layer_types
    ("no_rope_layers", dict(no_rope_layers=[1, 2, 1])),
    ("no_rope_layers", dict(no_rope_layers=[1, 0])),  # fewer than the layers
    ("interleave_moe_layer_step", dict(moe_layers=None, interleave_moe_layer_step=0)),
    ("moe_layers", dict(moe_layers="all")),
    ("floor_scale", dict(floor_scale=0)),
    ("num_experts_per_tok", dict(num_experts_per_tok=9)),
    ("dynamic", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
]


@pytest.mark.parametrize("field, changes", REFUSED, ids=[f"{field}-{i}" for i, (field, _) in enumerate(REFUSED)])
def test_unsupported_config_values_are_refused(field, changes):
    with pytest.raises(CheckpointError, match=field):
        parse_config(CheckpointConfig("tiny", _config(**changes)))


def test_quantized_fused_experts_are_refused(tmp_path):
    """Fused experts in a float8 dtype would need their scales: refused, not cast."""
    tiny_model().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.feed_forward.experts.gate_up_proj"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="quantized fused experts"):
        load_model(tmp_path)
