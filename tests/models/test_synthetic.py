"""Synthetic checkpoints: transformers loads them with no missing or unexpected keys, the tensor names and shapes
are those transformers itself writes, the tokenizer round-trips and applies ChatML, and a seed fixes the bytes."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from cpumoe.cli import main
from cpumoe.models import ARCHITECTURES
from cpumoe.synthetic import make_checkpoint, make_tokenizer, tiny_overrides
from cpumoe.synthetic.checkpoint import build_config

PRESETS = [arch.presets[0].name for arch in ARCHITECTURES.values()]   # one per architecture
VOCAB = 512


def _tiny(preset, out, **kw):
    return make_checkpoint(preset, out, layers=2, vocab=VOCAB, overrides=tiny_overrides(preset), **kw)


def _shapes(directory) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return shapes


@pytest.mark.parametrize("preset", PRESETS)
def test_transformers_loads_and_runs(preset, tmp_path):
    out = _tiny(preset, tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("Return the sum of a list of numbers.", return_tensors="pt").input_ids
    logits = model(ids).logits   # [1, T, V]
    assert logits.shape == (1, ids.shape[1], VOCAB) and torch.isfinite(logits).all()
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config["bos_token_id"] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert config["architectures"] == [type(model).__name__] and config["dtype"] == "bfloat16"


@pytest.mark.parametrize("preset", PRESETS)
def test_names_and_shapes_match_save_pretrained(preset, tmp_path):
    """The on-disk names and shapes equal those of a transformers model of the same config saved by transformers."""
    out = _tiny(preset, tmp_path / "synthetic")
    config = build_config(preset, layers=2, vocab=VOCAB, dtype=torch.float32, special_ids={},
                          overrides=tiny_overrides(preset))
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "reference")
    assert _shapes(out) == _shapes(tmp_path / "reference")


def test_real_shapes():
    """Without overrides the real per-layer shapes are planned (nothing is written)."""
    from cpumoe.synthetic.checkpoint import plan_tensors
    config = build_config("qwen3-30b-a3b", layers=1, vocab=151936, dtype=torch.bfloat16, special_ids={})
    shapes = {p.name: p.shape for p in plan_tensors("qwen3-30b-a3b", config)}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32 * 128, 2048)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (4 * 128, 2048)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["model.layers.0.mlp.gate.weight"] == (128, 2048)
    assert shapes["model.layers.0.mlp.experts.127.gate_proj.weight"] == (768, 2048)
    assert shapes["model.layers.0.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert shapes["lm_head.weight"] == (151936, 2048)
    mixtral = build_config("mixtral-8x7b", layers=1, vocab=32000, dtype=torch.bfloat16, special_ids={})
    shapes = {p.name: p.shape for p in plan_tensors("mixtral-8x7b", mixtral)}
    assert shapes["model.layers.0.block_sparse_moe.experts.7.w1.weight"] == (14336, 4096)
    assert shapes["model.layers.0.block_sparse_moe.experts.7.w2.weight"] == (4096, 14336)


def test_same_seed_same_bytes(tmp_path):
    a, b, c = (_tiny("qwen3-30b-a3b", tmp_path / name, seed=seed) for name, seed in (("a", 1), ("b", 1), ("c", 2)))
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_sharded_write_loads(tmp_path):
    out = _tiny("mixtral-8x7b", tmp_path / "sharded", max_shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(p.name for p in out.glob("model-*.safetensors"))
    assert not (out / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(
        torch.Size(s).numel() * 2 for s in _shapes(out).values())
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    single = _tiny("mixtral-8x7b", tmp_path / "single")   # the shard plan does not change any tensor
    with safe_open(single / "model.safetensors", "pt") as st:
        for name, file in index["weight_map"].items():
            with safe_open(out / file, "pt") as part:
                assert torch.equal(st.get_tensor(name), part.get_tensor(name)), name


def test_tokenizer(tmp_path):
    make_tokenizer(tmp_path, 1000)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "héllo 世界 🙂 def f(x):\n    return x"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer) <= 1000
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="below"):
        make_tokenizer(tmp_path, 100)


def test_cli(tmp_path, capsys):
    assert main(["make-model", "--preset", "olmoe-1b-7b", "--layers", "1", "--vocab", "600", "--tiny",
                 "--dtype", "fp32", "--out", str(tmp_path)]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == 600 and config["dtype"] == "float32"


def test_unknown_preset(tmp_path):
    with pytest.raises(ValueError, match="known: qwen3-30b-a3b, qwen3-235b-a22b, olmoe-1b-7b"):
        make_checkpoint("no-such-model", tmp_path, layers=1)
    with pytest.raises(SystemExit, match="known"):
        main(["make-model", "--preset", "no-such-model", "--out", str(tmp_path)])


# Published total parameter counts (billions, model cards). Llama-4's include the vision tower (~1%) and GLM-4.5's
# its multi-token-prediction layer (~1%); make-model writes neither, as cpumoe reads neither.
PUBLISHED_BILLIONS = {
    "qwen3-30b-a3b": 30.5, "qwen3-235b-a22b": 235, "olmoe-1b-7b": 6.92, "qwen1.5-moe-a2.7b": 14.3,
    "qwen2-57b-a14b": 57.4, "deepseek-v2-lite": 15.7, "deepseek-v3": 671, "moonlight-16b-a3b": 16.0,
    "mixtral-8x7b": 46.7, "mixtral-8x22b": 141, "gpt-oss-20b": 20.9, "gpt-oss-120b": 116.8,
    "llama-4-scout-17b-16e": 109, "llama-4-maverick-17b-128e": 400, "glm-4.5-air": 106, "glm-4.5": 355,
    "phi-3.5-moe": 41.9, "gemma-4-26b-a4b": 25.2,
}


def test_every_preset_plans_the_real_model():
    """Each preset's full plan (real layers and vocabulary, nothing written) adds up to the model's published size:
    the presets hold the real shapes, and the plan (cpumoe's own model of the config) names every tensor."""
    from cpumoe.models import model_presets
    from cpumoe.synthetic.checkpoint import plan_tensors

    presets = model_presets()
    assert set(presets) == set(PUBLISHED_BILLIONS), "a preset without a published size here, or the reverse"
    for name, (_, preset) in presets.items():
        config = build_config(name, layers=preset.config["num_hidden_layers"], vocab=preset.config["vocab_size"],
                              dtype=torch.bfloat16,
                              special_ids={})
        total = sum(torch.Size(p.shape).numel() for p in plan_tensors(name, config)) / 1e9
        assert total == pytest.approx(PUBLISHED_BILLIONS[name], rel=0.015), f"{name}: {total:.2f}B planned"
