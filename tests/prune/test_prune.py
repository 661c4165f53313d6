"""`cpumoe prune` on a model whose routing is forced (tests/bench/activation/forced.py): inter-expert pruning drops
exactly the never-chosen experts, renumbers the rest and leaves every token's output unchanged; intra-expert
pruning drops a channel made the weakest on purpose; transformers and cpumoe load every pruned checkpoint and agree
on its logits; bad input is refused with a message that names the problem."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpumoe.cli import main
from cpumoe.loader import Checkpoint
from cpumoe.models import load_model
from cpumoe.prune.calibration import calibration_counts
from cpumoe.prune.checkpoint import prune_checkpoint
from cpumoe.prune.select import channel_scores, least_used
from tests.bench.activation.forced import E, I, forced_checkpoint

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # fp32: max |cpumoe - transformers| / max |transformers| over the logits
IDS = torch.tensor([1, 40, 2, 50, 3, 33, 31, 63, 17, 45, 9])


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    return forced_checkpoint(tmp_path_factory.mktemp("forced") / "ckpt")


def tensors(path) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint(path)
    return {k: ckpt.read(k) for k in ckpt.keys()}


def rel_err(ours, theirs) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def check_transformers_agrees(path, ids=IDS) -> torch.Tensor:
    """transformers loads `path` with no missing or unexpected weights, and its logits equal cpumoe's."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.set_experts_implementation("eager")  # the per-expert loop: grouped_mm wants 16-byte strides
    with torch.no_grad():
        theirs = model.float()(ids[None]).logits[0].float()  # [T, V]
    ours = load_model(path)(ids)  # [T, V]
    assert rel_err(ours, theirs) <= TOL, f"{path}: cpumoe and transformers differ by {rel_err(ours, theirs):.2e}"
    return ours


@pytest.mark.parametrize("ratio,dropped", [(0.25, {0: [2, 3], 1: [0, 1]}),
                                           (0.5, {0: [2, 3, 4, 5], 1: [0, 1, 6, 7]})], ids=["0.25", "0.5"])
def test_inter_drops_the_never_chosen_experts(forced, tmp_path, ratio, dropped):
    counts, name, tokens = calibration_counts(forced, random=64, max_len=32)
    assert name == "random" and tokens == 64 and set(counts) == {0, 1}
    assert all(int(counts[layer][d].sum()) == 0 for layer, ids in dropped.items() for d in ids)
    result = prune_checkpoint(forced, tmp_path / "out", method="inter", ratio=ratio, counts=counts)
    assert result.dropped_experts == dropped and result.experts == (E, E - len(dropped[0]))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    named = [config[f] for f in ("num_experts", "num_local_experts", "n_routed_experts") if f in config]
    assert named == [E - len(dropped[0])] and config["num_experts_per_tok"] == 2
    src, out = tensors(forced), tensors(tmp_path / "out")
    for layer, ids in dropped.items():
        kept = [e for e in range(E) if e not in ids]
        p = f"model.layers.{layer}.mlp."
        torch.testing.assert_close(out[p + "gate.weight"], src[p + "gate.weight"][kept], rtol=0, atol=0,
                                   msg=f"layer {layer}: router rows of the kept experts, in order")
        for new, old in enumerate(kept):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"{p}experts.{{}}.{proj}.weight"
                torch.testing.assert_close(out[name.format(new)], src[name.format(old)], rtol=0, atol=0,
                                           msg=f"layer {layer}: expert {old} renumbered {new}")
        assert f"{p}experts.{len(kept)}.gate_proj.weight" not in out
    assert len(out) == len(src) - 3 * 2 * len(dropped[0])
    # every token routes to kept experts only (and the top-k weights are renormalized): the same logits
    pruned = check_transformers_agrees(tmp_path / "out")
    torch.testing.assert_close(pruned, load_model(forced)(IDS), rtol=1e-5, atol=1e-5,
                               msg="tokens routed only to kept experts changed their output")
    for f in ("generation_config.json", "pruning.json"):
        assert (tmp_path / "out" / f).is_file()


def test_intra_drops_the_weakest_channel(forced, tmp_path):
    src_dir = tmp_path / "src"
    shutil.copytree(forced, src_dir)
    weights = load_file(src_dir / "model.safetensors")
    weights["model.layers.0.mlp.experts.3.gate_proj.weight"][5] *= 1e-3  # channel 5 of layer 0's expert 3
    save_file(weights, str(src_dir / "model.safetensors"), metadata={"format": "pt"})
    result = prune_checkpoint(src_dir, tmp_path / "out", method="intra", ratio=1 / 16)
    assert result.inter_size == (I, I - 1)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["moe_intermediate_size"] == I - 1
    src, out = tensors(src_dir), tensors(tmp_path / "out")
    for layer in (0, 1):
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            gate, up, down = (src[p + f"{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
            by_hand = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)  # [I]
            weakest = int(by_hand.argmin())
            if (layer, e) == (0, 3):
                assert weakest == 5
            keep = [c for c in range(I) if c != weakest]
            torch.testing.assert_close(out[p + "gate_proj.weight"], gate[keep], rtol=0, atol=0, msg=p)
            torch.testing.assert_close(out[p + "up_proj.weight"], up[keep], rtol=0, atol=0, msg=p)
            torch.testing.assert_close(out[p + "down_proj.weight"], down[:, keep], rtol=0, atol=0, msg=p)
    torch.testing.assert_close(out["model.layers.1.mlp.gate.weight"], src["model.layers.1.mlp.gate.weight"],
                               rtol=0, atol=0, msg="the router is not touched by intra pruning")
    check_transformers_agrees(tmp_path / "out")


def test_selection_ties_and_groups():
    counts = torch.tensor([5, 0, 3, 0, 0, 9, 1, 2])
    assert least_used(counts, 2) == [1, 3]  # three zeros: the lower ids go first
    assert least_used(counts, 4, groups=2) == [1, 3, 4, 6]  # two from each group of 4
    scores = channel_scores(torch.ones(3, 2), torch.tensor([[1.0, 0], [2, 0], [3, 0]]), torch.ones(2, 3))
    assert scores.tolist() == pytest.approx([2 ** 0.5 * 1 * 2 ** 0.5, 2 ** 0.5 * 2 * 2 ** 0.5, 2 ** 0.5 * 3 * 2 ** 0.5])


def test_cli_prune(forced, tmp_path, capsys):
    assert main(["prune", str(forced), str(tmp_path / "inter"), "--method", "inter", "--ratio", "0.25",
                 "--calibration-random", "64"]) == 0
    out = capsys.readouterr().out
    assert "8 -> 6 experts" in out and "layer 0: dropped experts [2, 3]" in out
    assert main(["prune", str(forced), str(tmp_path / "intra"), "--method", "intra", "--ratio", "0.5"]) == 0
    assert "16 -> 8" in capsys.readouterr().out
    assert load_model(tmp_path / "intra").config.moe_intermediate_size == 8


def test_bad_input(forced, tmp_path):
    def prune(*args):
        return main(["prune", str(forced), str(tmp_path / "out"), *args])

    for ratio in ("0", "1", "1.5", "-0.25", "x"):
        with pytest.raises(SystemExit):
            prune("--method", "intra", "--ratio", ratio)
    with pytest.raises(SystemExit):
        prune("--method", "both", "--ratio", "0.5")
    with pytest.raises(SystemExit, match="cpumoe prune: error: num_experts_per_tok 2 would exceed the 1 experts"):
        prune("--method", "inter", "--ratio", "0.875", "--calibration-random", "16")
    with pytest.raises(SystemExit, match="ratio 0.01 of 16 intermediate channels drops none"):
        prune("--method", "intra", "--ratio", "0.01")
    with pytest.raises(ValueError, match="unknown pruning method"):
        prune_checkpoint(forced, tmp_path / "out", method="inter-expert", ratio=0.5)
    with pytest.raises(ValueError, match="needs routing counts"):
        prune_checkpoint(forced, tmp_path / "out", method="inter", ratio=0.5)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(SystemExit, match="is not an empty directory"):
        main(["prune", str(forced), str(tmp_path / "full"), "--method", "intra", "--ratio", "0.5"])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["prune", str(tmp_path / "nope"), str(tmp_path / "out2"), "--method", "intra", "--ratio", "0.5"])


def test_quantized_and_gpt_oss_are_refused(forced, tmp_path):
    from cpumoe.loader.quantized.convert import quantize_checkpoint
    quantize_checkpoint(forced, tmp_path / "int8", "int8")
    with pytest.raises(SystemExit, match="is a quantized checkpoint"):
        main(["prune", str(tmp_path / "int8"), str(tmp_path / "out"), "--method", "intra", "--ratio", "0.5"])
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "num_local_experts": 4}))
    save_file({"model.norm.weight": torch.ones(4)}, str(gpt / "model.safetensors"))
    with pytest.raises(SystemExit, match="'gpt_oss' cannot be pruned: gpt-oss stores each layer's experts fused"):
        main(["prune", str(gpt), str(tmp_path / "out"), "--method", "inter", "--ratio", "0.5"])
