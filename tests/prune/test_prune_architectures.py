"""Inter- and intra-expert pruning of every supported architecture (tiny random transformers models saved with
save_pretrained): transformers and cpumoe both load the pruned checkpoint, with the same logits; the router rows,
DeepSeek-V3's correction bias and DeepSeek's shared experts follow."""
import json

import pytest
import torch

from cpumoe.loader import Checkpoint
from cpumoe.prune.calibration import calibration_counts
from cpumoe.prune.checkpoint import prune_checkpoint
from tests.prune.test_prune import check_transformers_agrees

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([111, 87, 25, 71, 115, 92, 74, 62, 46, 32, 88])


def _tiny(model_type: str):
    if model_type == "deepseek_v3":
        from tests.models.test_deepseek_v3 import E16_TOP4, tiny_model
        return tiny_model(**E16_TOP4, norm_topk_prob=True, q_lora_rank=24)
    if model_type == "deepseek_v2":
        from tests.models.test_deepseek_v2 import tiny_model
        return tiny_model(topk_method="group_limited_greedy", n_group=2, topk_group=1, q_lora_rank=None)
    from tests.models.test_architectures import ARCHS
    return ARCHS[model_type].tiny_model()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["mixtral", "olmoe", "qwen2_moe", "deepseek_v2", "deepseek_v3"])
def test_prune_loads_in_both(model_type, tmp_path):
    src = tmp_path / "src"
    _tiny(model_type).save_pretrained(src)
    counts, _, _ = calibration_counts(src, random=128, max_len=32)
    ckpt = Checkpoint(src)
    inter = prune_checkpoint(src, tmp_path / "inter", method="inter", ratio=0.25, counts=counts)
    E = inter.experts[0]
    assert inter.experts[1] == E - E // 4
    out = Checkpoint(tmp_path / "inter")
    for layer, dropped in inter.dropped_experts.items():
        kept = [e for e in range(E) if e not in dropped]
        prefix = next(k for k in ckpt.keys() if k.startswith(f"model.layers.{layer}.") and k.endswith(".gate.weight"))
        torch.testing.assert_close(out.read(prefix), ckpt.read(prefix)[kept], rtol=0, atol=0, msg=prefix)
        bias = prefix.replace(".weight", ".e_score_correction_bias")
        if bias in ckpt:
            torch.testing.assert_close(out.read(bias), ckpt.read(bias)[kept], rtol=0, atol=0, msg=bias)
        if model_type in ("deepseek_v2", "deepseek_v3"):  # dropped evenly from every routing group
            groups = ckpt.config["n_group"]
            assert [sum(d // (E // groups) == g for d in dropped) for g in range(groups)] == [E // groups // 4] * groups
    check_transformers_agrees(tmp_path / "inter", IDS)

    intra = prune_checkpoint(src, tmp_path / "intra", method="intra", ratio=0.25)
    I = intra.inter_size[0]
    config = json.loads((tmp_path / "intra" / "config.json").read_text())
    assert intra.inter_size[1] == I - I // 4 and I - I // 4 in config.values()
    check_transformers_agrees(tmp_path / "intra", IDS)
