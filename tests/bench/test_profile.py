"""The decode-step profile: groups that add up to the step, every group seen, and the model left as it was."""
import json

import pytest
import torch

from cpumoe.bench import profile
from cpumoe.bench.model import ModelCase, engine_config
from cpumoe.cli import main
from cpumoe.engine import LLMEngine
from cpumoe.synthetic.checkpoint import make_checkpoint, tiny_overrides


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("qwen3-30b-a3b", tmp_path_factory.mktemp("ckpt"), layers=2, vocab=400,
                           dtype=torch.float32, overrides=tiny_overrides("qwen3-30b-a3b"))


def test_step_clock_charges_the_innermost_open_group(monkeypatch):
    ticks = iter([0.0, 1.0, 3.0, 6.0, 10.0])  # start, open experts, open attention, close, stop
    monkeypatch.setattr(profile.time, "perf_counter", lambda: next(ticks))
    clock = profile.StepClock()
    clock.start("engine")
    clock.open("experts")
    clock.open("attention")
    clock.close()
    clock.stop()
    assert clock.seconds == {"experts": 2.0 + 4.0, "dense GEMMs": 0.0, "attention": 3.0, "glue": 0.0, "engine": 1.0}


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_profile_adds_up_and_sees_every_group(checkpoint, batch):
    engine = LLMEngine(str(checkpoint), config=engine_config([ModelCase(batch, 12, 12)]))
    originals = {(module, name): getattr(module, name) for module, name in profile.ATTENTION_FUNCTIONS}
    p = profile.profile_decode(engine, batch, 12, steps=4)
    assert p.batch == batch and p.steps == 4
    assert all(p.groups_ms[g] > 0 for g in profile.GROUPS), p.groups_ms
    # exclusive times partition the profiled step (the clock brackets engine.step itself)
    assert sum(p.groups_ms.values()) == pytest.approx(p.step_ms, rel=0.25)
    assert sum(p.share(g) for g in profile.GROUPS) == pytest.approx(1.0)
    # nothing left behind: no hooks, the attention functions restored, no request still running
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in engine.model.modules())
    assert {(module, name): getattr(module, name) for module, name in originals} == originals
    assert not engine.has_unfinished()


def test_bench_model_profile_flag(checkpoint, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["bench", "model", str(checkpoint), "--profile", "--batch", "1,2", "--input-len", "10",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [p["batch"] for p in report["profiles"]] == [1, 2]
    for p in report["profiles"]:
        assert set(p["groups_ms"]) == set(profile.GROUPS) and p["plain_step_ms"] > 0
    text = capsys.readouterr().out
    assert "decode step profile" in text and "dense GEMMs" in text and "step, no hooks" in text
