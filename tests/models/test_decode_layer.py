"""Decode steps as one C++ call (models/decode_layer.py, ops.DecodeModel) and with each layer as one
(ops.DecodeLayer), against the modules they stand for: the engine's logits are the same bit for bit, step after step,
for every architecture whose layers fuse (bf16, float32, and int8 / int4 quantized checkpoints); the others say why
they run the modules; batch-invariant engines and prefill steps keep the modules; the profile still charges the fused
GEMMs, attention and experts to their groups."""
import logging

import pytest
import torch

from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams
from cpumoe.models import ARCHITECTURES
from cpumoe.models.decode_layer import fused_decode_layer
from tests.models.test_conformance import tiny_model

# the architectures whose every layer is the plain pre-norm attention + routed-experts layer (no shared expert,
# no grouped routing, no sinks or window, per-head or no q/k norm)
FUSED = {"mixtral", "qwen3_moe"}
# k and v of 2 x 32 rows fill whole packed blocks, so q/k/v join (the tiny presets' 2 x 16 do not, and then the
# layers say so and run the modules)
JOINABLE = dict(head_dim=32, num_key_value_heads=2)
PROMPTS = [[5, 9, 2, 33, 7], [1, 4, 4, 8, 100, 3, 6, 2, 9], [77, 12]]


def engine_for(path, dtype=torch.bfloat16, **config) -> LLMEngine:
    return LLMEngine(path, dtype=dtype, skip_tokenizer=True,
                     config=EngineConfig(num_blocks=64, enable_prefix_caching=False, **config))


MODES = ("step", "layers", "modules")  # the whole step as one call, a call a layer, the modules


def step_logits(engine: LLMEngine, mode: str, max_tokens: int = 6) -> list[tuple[str | None, torch.Tensor]]:
    """(which fused path the step ran: "step", "layers" or None, its logits) for every model call of a greedy
    generate, with the engine's decode steps run as `mode` says."""
    model, decoder = engine.model, engine.model.model
    plans, whole = decoder.decode_layers, model.decode_step
    decoder.decode_layers = plans if mode != "modules" else None
    model.decode_step = whole if mode == "step" else None
    calls = []
    forward, layers_step = model.forward, decoder._decode_step

    def recording_layers(*args, **kwargs):
        calls[-1][0] = "layers"
        return layers_step(*args, **kwargs)

    def recording_whole(*args, **kwargs):
        calls[-1][0] = "step"
        return whole_forward(*args, **kwargs)

    def recording(*args, **kwargs):
        calls.append([None, None])
        calls[-1][1] = forward(*args, **kwargs)
        return calls[-1][1]

    model.forward, decoder._decode_step = recording, recording_layers
    if whole is not None:
        whole_forward, whole.forward = whole.forward, recording_whole
    try:
        engine.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    finally:
        del model.forward, decoder._decode_step
        if whole is not None:
            del whole.forward
        decoder.decode_layers, model.decode_step = plans, whole
    return [(ran, logits) for ran, logits in calls]


def assert_same_steps(engine: LLMEngine, whole_step: bool = True) -> None:
    """The logits of every step are the same bit for bit whether decode steps run the modules, the fused layers or
    (whole_step) the fused whole step; each fused mode ran at least one step its own way."""
    runs = {mode: step_logits(engine, mode) for mode in (MODES if whole_step else MODES[1:])}
    modules = runs.pop("modules")
    assert not any(ran for ran, _ in modules)
    for mode, fused in runs.items():
        assert len(fused) == len(modules)
        assert any(ran == mode for ran, _ in fused), f"no step ran the fused {mode}"
        for i, ((_, a), (_, b)) in enumerate(zip(fused, modules)):
            assert torch.equal(a, b), f"{mode}, step {i}"


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_fused_layers_change_no_bit(model_type, tmp_path, caplog):
    arch = ARCHITECTURES[model_type]
    tiny_model(arch, torch.bfloat16, **(JOINABLE if model_type in FUSED else {})).save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="cpumoe"):
        engine = engine_for(tmp_path)
    plans = engine.model.model.decode_layers
    assert (plans is not None) == (model_type in FUSED), model_type
    if plans is None:  # the log says which layer and why
        assert "decode steps run the modules (layer " in caplog.text
        return
    assert "decode steps run as one C++ call" in caplog.text
    assert engine.model.decode_step is not None and engine.model.decode_step.runs_lm_head
    assert_same_steps(engine)


def test_a_tied_lm_head_runs_after_the_fused_step(tmp_path, caplog):
    """The step stops at the final norm where the lm_head is not a packed linear of its own (tied to the embedding
    table here), and compute_logits goes on: the same logits."""
    tiny_model(ARCHITECTURES["qwen3_moe"], torch.bfloat16, tie_word_embeddings=True, **JOINABLE).save_pretrained(
        tmp_path)
    with caplog.at_level(logging.INFO, logger="cpumoe"):
        engine = engine_for(tmp_path)
    assert engine.model.lm_head is None and not engine.model.decode_step.runs_lm_head
    assert "up to the final norm" in caplog.text
    assert_same_steps(engine)


def test_fused_layers_in_float32(tmp_path):
    tiny_model(ARCHITECTURES["qwen3_moe"], torch.float32, **JOINABLE).save_pretrained(tmp_path)
    assert_same_steps(engine_for(tmp_path, torch.float32))


@pytest.mark.parametrize("fmt, lm_head", [("int8", False), ("int4", False), ("int4", True)])
def test_fused_layers_of_a_quantized_checkpoint(fmt, lm_head, tmp_path):
    """Quantized projections and experts (cpumoe quantize's layouts), and a quantized lm_head, run in the fused
    layers and step as in the modules."""
    from cpumoe.loader.quantized.convert import quantize_checkpoint
    tiny_model(ARCHITECTURES["qwen3_moe"], torch.bfloat16, **JOINABLE).save_pretrained(tmp_path / "bf16")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / fmt, fmt, group_size=32 if fmt == "int4" else None,
                        lm_head=lm_head)
    engine = engine_for(tmp_path / fmt)
    assert (type(engine.model.lm_head).__name__ == "QuantizedLinear") == lm_head
    assert engine.model.model.decode_layers is not None and engine.model.decode_step is not None
    assert_same_steps(engine)


def test_batch_invariant_engines_run_the_modules(tmp_path):
    """Their attention is row_attention over each token's own keys, which the fused layer does not run."""
    tiny_model(ARCHITECTURES["qwen3_moe"], torch.bfloat16, **JOINABLE).save_pretrained(tmp_path)
    model = engine_for(tmp_path, batch_invariant=True).model
    assert model.model.decode_layers is None and model.decode_step is None


def test_a_layer_that_cannot_fuse_says_why(tmp_path):
    tiny_model(ARCHITECTURES["qwen2_moe"], torch.bfloat16, **JOINABLE).save_pretrained(tmp_path)
    engine = engine_for(tmp_path)
    plan, why = fused_decode_layer(engine.model.model.layers[0])
    assert plan is None and "shared expert" in why
    assert engine.model.model.fuse_decode_layers() == f"layer 0: {why}"


def test_the_profile_charges_fused_layers_to_their_groups(tmp_path):
    from cpumoe.bench.profile import profile_decode
    tiny_model(ARCHITECTURES["qwen3_moe"], torch.bfloat16, **JOINABLE).save_pretrained(tmp_path)
    engine = engine_for(tmp_path)
    assert engine.model.model.decode_layers is not None
    profile = profile_decode(engine, batch=2, input_len=8, steps=3)
    for group in ("experts", "dense GEMMs", "attention"):
        assert profile.groups_ms[group] > 0, group
    assert profile.groups_ms["glue"] >= 0
    assert abs(sum(profile.groups_ms.values()) - profile.step_ms) < 0.5 * profile.step_ms


def test_expert_counts_see_the_fused_layers_routing(tmp_path):
    """bench model's ExpertCounter counts the distinct experts of decode steps whether the step runs fused (the
    layers' routed_ids, after the whole step or after each layer) or as modules (hooks on FusedMoE): the same counts,
    step by step."""
    from cpumoe.bench.model import ExpertCounter
    tiny_model(ARCHITECTURES["qwen3_moe"], torch.bfloat16, **JOINABLE).save_pretrained(tmp_path)
    engine = engine_for(tmp_path)
    model, decoder = engine.model, engine.model.model
    plans, whole = decoder.decode_layers, model.decode_step
    counts = {}
    for mode in MODES:
        decoder.decode_layers = plans if mode != "modules" else None
        model.decode_step = whole if mode == "step" else None
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"{mode}-{i}", prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        per_step = []
        with ExpertCounter(engine.model) as counter:
            while engine.has_unfinished():
                counter.counting = True
                engine.step()
                per_step.append(counter.take())
        counts[mode] = per_step
        assert decoder.decode_routing_hooks == []
    decoder.decode_layers, model.decode_step = plans, whole
    assert counts["step"] == counts["layers"] == counts["modules"] and any(c is not None for c in counts["step"])
