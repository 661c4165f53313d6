# The `cpumoe` command: `info` names the oracle's choice for a preset and lists every path; bad arguments end with
# a clear message and a non-zero exit.
import subprocess
import sys

import pytest
import torch

from cpumoe.bench.layer import experts_config
from cpumoe.cli import main
from cpumoe.experts import all_paths, choose_path
from cpumoe.presets import get_preset


def test_info_names_choice_and_every_path(capsys):
    assert main(["info", "--preset", "qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    chosen = choose_path(experts_config(get_preset("qwen3-30b-a3b"), torch.bfloat16)).name
    assert f"the oracle chooses {chosen}" in out
    for p in all_paths():
        assert p.name in out


def test_info_fp16_rejects_bf16_only_paths(capsys):
    assert main(["info", "--preset", "olmoe-1b-7b", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    config = experts_config(get_preset("olmoe-1b-7b"), torch.float16)
    for p in all_paths():
        ok, why = p.is_supported(config)
        if not ok:
            assert f"not supported: {why}" in out


def test_unknown_preset(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--preset", "no-such-model"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "unknown preset 'no-such-model'" in err and "qwen3-30b-a3b" in err


@pytest.mark.parametrize("argv, message", [
    (["bench", "layer", "--tokens", "1,x"], "expected comma-separated integers"),
    (["bench", "layer", "--tokens", "0"], "expected positive integers"),
    (["bench", "layer", "--dtype", "int8"], "unknown dtype 'int8'"),
    (["bench"], "required"),
    ([], "required"),
], ids=["tokens-not-int", "tokens-zero", "dtype", "bench-no-subcommand", "no-command"])
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
