"""cpumoe's Qwen3-MoE against transformers', beyond the conformance test: config variants, sharded and fused
checkpoints, and the loader's errors on broken checkpoints (missing tensors, files, shards, unknown model types).

Tolerances, as max |ours - theirs| / max |theirs| over the logits: fp32 1e-4, bf16 2e-2.
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from cpumoe.loader import Checkpoint, CheckpointError  # noqa: E402
from cpumoe.models import ARCHITECTURES, load_model  # noqa: E402
from tests.models.tiny import rel_err  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# [1, 11]; chosen so that no token's 2nd and 3rd expert nearly tie in bf16 (see min_router_margin): a near
# tie lets bf16 rounding pick a different expert, and one rerouted token moves the logits by ~10%.
PROMPT = torch.tensor([[111, 87, 25, 71, 115, 92, 74, 62, 46, 32, 88]])


def tiny_config(**overrides):
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              mlp_only_layers=[1], norm_topk_prob=True, rope_theta=1e4)
    kw.update(overrides)
    return transformers.Qwen3MoeConfig(**kw)


def tiny_model(dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(tiny_config(**overrides))
    with torch.no_grad():  # init std 0.02 gives near-flat logits and routing; spread them out
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    return model.to(dtype).eval()


def save(model, path, **kw):
    model.save_pretrained(path, **kw)
    return path


@pytest.fixture(scope="module")
def fp32_pair(tmp_path_factory):
    model = tiny_model()
    return model, save(model, tmp_path_factory.mktemp("fp32"))


def test_on_disk_names_are_per_expert(fp32_pair):
    _, path = fp32_pair
    keys = set(Checkpoint(path).keys())
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys
    assert "model.layers.1.mlp.gate_proj.weight" in keys  # mlp_only_layers=[1] -> dense
    assert not any("gate_up_proj" in k for k in keys)


@pytest.mark.parametrize("variant", [
    dict(tie_word_embeddings=True, norm_topk_prob=False),
    dict(decoder_sparse_step=2, mlp_only_layers=[]),
], ids=["tied-no-renorm", "sparse-step-2"])
def test_config_variants(variant, tmp_path):
    theirs_model = tiny_model(**variant)
    ours = load_model(save(theirs_model, tmp_path))
    with torch.no_grad():
        theirs = theirs_model(PROMPT).logits
    assert rel_err(ours(PROMPT), theirs) <= TOL[torch.float32]


def test_sharded_and_fused_checkpoints(fp32_pair, tmp_path):
    model, path = fp32_pair
    with torch.no_grad():
        theirs = model(PROMPT).logits
    sharded = save(model, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert rel_err(load_model(sharded)(PROMPT), theirs) <= TOL[torch.float32]

    # transformers' in-memory layout: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(path / "config.json", fused)
    tensors = {k: v for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    save_file({k: v.contiguous() for k, v in tensors.items()}, fused / "model.safetensors")
    assert rel_err(load_model(fused)(PROMPT), theirs) <= TOL[torch.float32]


def test_missing_tensor_is_named(fp32_pair, tmp_path):
    _, path = fp32_pair
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(path / "config.json", broken)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight.*broken"):
        load_model(broken)


def test_missing_files_and_keys(fp32_pair, tmp_path):
    _, path = fp32_pair
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nowhere")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_model(no_config)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(path / "config.json", no_weights)
    with pytest.raises(CheckpointError, match="no weights"):
        Checkpoint(no_weights)

    no_key = tmp_path / "no_key"
    shutil.copytree(path, no_key)
    config = json.loads((no_key / "config.json").read_text())
    del config["moe_intermediate_size"]
    (no_key / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="moe_intermediate_size"):
        load_model(no_key)


def test_missing_shard_is_named(fp32_pair, tmp_path):
    model, _ = fp32_pair
    sharded = save(model, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (sharded / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        Checkpoint(sharded)


def test_unknown_model_type_lists_supported(fp32_pair, tmp_path):
    _, path = fp32_pair
    other = tmp_path / "other"
    shutil.copytree(path, other)
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "llama9"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'llama9' is not supported; supported: " + ", ".join(sorted(ARCHITECTURES))):
        load_model(other)


def test_checkpoint_reads_headers_lazily(fp32_pair):
    _, path = fp32_pair
    ckpt = Checkpoint(path)
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert ckpt.shape(name) == (64, 32) and ckpt.dtype(name) == torch.float32
    assert ckpt.get(name).shape == (64, 32)
    with pytest.raises(CheckpointError, match="'nope'.*not found"):
        ckpt.shape("nope")

