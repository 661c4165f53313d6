"""A broken checkpoint is refused at load with one line naming the file (and the tensor or key), never a traceback
from deep inside, and never a model that loads but cannot run."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpumoe.cli import main
from cpumoe.loader import CheckpointError
from cpumoe.models import load_model
from cpumoe.synthetic.checkpoint import make_checkpoint, tiny_overrides


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_checkpoint("qwen3-30b-a3b", tmp_path_factory.mktemp("valid"), layers=2, vocab=400,
                           dtype=torch.float32, overrides=tiny_overrides("qwen3-30b-a3b"))


def _edit_config(d, **changes):
    config = json.loads((d / "config.json").read_text())
    config.update({k: v(config) if callable(v) else v for k, v in changes.items()})
    (d / "config.json").write_text(json.dumps(config))


def _shard(d, weight_map_of, extra=None):
    """Split model.safetensors into a.safetensors / b.safetensors with an index whose weight_map is
    weight_map_of(tensor names)."""
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    save_file({k: tensors[k] for k in names[:half]}, d / "a.safetensors")
    save_file({k: tensors[k] for k in names[half:]}, d / "b.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map_of(names, half)}))


def _retype(d, name, dtype):
    tensors = load_file(d / "model.safetensors")
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, d / "model.safetensors")


def _outside(d):
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    save_file(tensors, d.parent / f"{d.name}-outside.safetensors")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(tensors, f"../{d.name}-outside.safetensors")}))


BROKEN = {
    "config-not-json": (lambda d: (d / "config.json").write_text("{ not json"), "config.json: not valid JSON"),
    "config-not-object": (lambda d: (d / "config.json").write_text("[1, 2]"), "expected a JSON object"),
    "index-not-json": (lambda d: _shard(d, lambda n, h: {}) or (d / "model.safetensors.index.json").write_text("{"),
                       "index.json: not valid JSON"),
    "config-wrong-type": (lambda d: _edit_config(d, num_hidden_layers="2"), "num_hidden_layers must be an integer"),
    "config-bool-for-int": (lambda d: _edit_config(d, hidden_size=True), "hidden_size must be an integer"),
    "eps-not-a-number": (lambda d: _edit_config(d, rms_norm_eps="1e-6"), "rms_norm_eps must be a number"),
    "truncated-safetensors": (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:-4096]), "model.safetensors ends inside tensor"),
    "garbage-safetensors": (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64), "not a safetensors file"),
    "shard-outside-the-directory": (_outside, "shards must be files of"),
    "index-points-at-the-wrong-shard": (lambda d: _shard(d, lambda names, half: dict.fromkeys(names, "a.safetensors")),
                                        "which does not hold it"),
    "top-k-above-the-experts": (lambda d: _edit_config(d, num_experts_per_tok=lambda c: c.get("num_experts", c.get("num_local_experts")) + 1),
                                "num_experts_per_tok"),
    "more-layers-than-the-config": (lambda d: _edit_config(d, num_hidden_layers=1), "holds weights of layer 1"),
    "integer-weight": (lambda d: _retype(d, "model.norm.weight", torch.int32), "model.norm.weight"),
    "integer-expert-weight": (lambda d: _retype(d, "model.layers.0.mlp.experts.0.up_proj.weight", torch.int16),
                              "experts.0.up_proj.weight"),
}


@pytest.mark.parametrize("case", list(BROKEN), ids=list(BROKEN))
def test_broken_checkpoint_is_refused_naming_what(source, tmp_path, case):
    breaks, message = BROKEN[case]
    d = tmp_path / "ckpt"
    shutil.copytree(source, d)
    breaks(d)
    with pytest.raises(CheckpointError, match=message) as info:
        load_model(d)
    assert "\n" not in str(info.value)
    # the same one line from the command line, not a traceback
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(d), "--prompt", "Hi", "--max-tokens", "1"])
    assert str(exit_info.value.code).startswith("cpumoe generate: error:") and message.split(":")[0] in str(
        exit_info.value.code)


def test_the_source_loads(source):
    assert load_model(source) is not None


@pytest.mark.parametrize("file, text", [("tokenizer.json", '{"model": {"type": "BPE"}}'),   # the wrong schema
                                        ("tokenizer.json", "{not json"),
                                        ("tokenizer_config.json", '{"tokenizer_class": 5}')])
def test_a_broken_tokenizer_is_refused_naming_it(source, tmp_path, file, text):
    from cpumoe.engine import EngineConfig, LLMEngine
    d = tmp_path / "ckpt"
    shutil.copytree(source, d)
    (d / file).write_text(text)
    with pytest.raises(CheckpointError, match="the tokenizer .* cannot be loaded") as info:
        LLMEngine(d, config=EngineConfig(num_blocks=8))
    assert file in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(SystemExit, match="cpumoe generate: error: .* the tokenizer"):
        main(["generate", str(d), "--prompt", "Hi", "--max-tokens", "1"])
