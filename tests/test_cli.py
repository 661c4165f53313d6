# The `cpumoe` command: `info` names the oracle's choice for a preset and lists every backend; bad arguments end with
# a clear message and a non-zero exit.
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from cpumoe.bench.layer import experts_config, parse_weight_format
from cpumoe.cli import main
from cpumoe.experts import all_backends, backend_report, choose_backend
from cpumoe.presets import get_preset


def test_info_names_choice_and_every_backend(capsys):
    assert main(["info", "--preset", "qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    chosen = choose_backend(experts_config(get_preset("qwen3-30b-a3b"), torch.bfloat16)).name
    assert f"the oracle chooses {chosen}" in out
    for p in all_backends():
        assert p.name in out
    from cpumoe import ops
    assert f"decode attention runs on {ops.attention_backends()[0]}" in out
    assert ops.attention_scope(ops.attention_backends()[0]) in " ".join(out.split())  # what it hands on, if anything
    prefill = ops.prefill_attention_backend()
    assert (f"prefill attention runs on {prefill}" if prefill else "prefill attention runs the blocked torch") in out
    from cpumoe.memory import huge_page_advice
    # the kernel's settings (the free memory after them moves from one read to the next)
    settings = huge_page_advice().split(";")[0]
    assert f"huge pages the packed weights and the KV cache ask for 2 MB pages; {settings}" in " ".join(out.split())


def test_info_fp16_rejects_bf16_only_backends(capsys):
    assert main(["info", "--preset", "olmoe-1b-7b", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    config = experts_config(get_preset("olmoe-1b-7b"), torch.float16)
    for p in all_backends():
        ok, why = p.is_supported(config)
        if not ok:
            assert f"not supported: {why}" in out


def test_info_quantized_formats(capsys, monkeypatch):
    """Every quantized format: the oracle's choice for the layer and every backend's verdict, from backend_report."""
    monkeypatch.setattr("cpumoe.cli.stdout_console", lambda: Console(width=500))   # no reason wrapped over two lines
    assert main(["info", "--preset", "qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    preset = get_preset("qwen3-30b-a3b")
    for name in ("int8", "int4", "fp8", "mxfp4"):
        fmt = parse_weight_format(name, 128)
        config = experts_config(preset, fmt)
        assert f"{fmt.describe()}: the oracle chooses {choose_backend(config).name}" in out
        for backend, ok, why in backend_report(config):
            assert ok or why in out, (fmt.name, backend, why)


def test_info_one_format(capsys):
    assert main(["info", "--preset", "olmoe-1b-7b", "--quant", "int4", "--group-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "int4_w4a16 g64 (bfloat16 activations): the oracle chooses" in out
    # only int4's choice line (other formats may appear in a backend's reason: "has no ... tiles (has ...)")
    assert "the oracle chooses" in out and "int8_w8a8 per channel" not in out and "mxfp4_w4a16 g32" not in out


def test_unknown_preset(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--preset", "no-such-model"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "unknown preset 'no-such-model'" in err and "qwen3-30b-a3b" in err


@pytest.mark.parametrize("argv, message", [
    (["bench", "layer", "--tokens", "1,x"], "expected comma-separated integers"),
    (["bench", "layer", "--tokens", "0"], "expected positive integers"),
    (["bench", "layer", "--dtype", "bf16,int3"], "unknown dtype 'int3'"),
    (["info", "--quant", "int3"], "unknown quantization format 'int3'"),
    (["bench"], "required"),
    ([], "required"),
], ids=["tokens-not-int", "tokens-zero", "dtype", "quant", "bench-no-subcommand", "no-command"])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_python_m_cpumoe():
    done = subprocess.run([sys.executable, "-m", "cpumoe", "info", "--preset", "gpt-oss-20b"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "gpt-oss-20b" in done.stdout and "naive" in done.stdout
