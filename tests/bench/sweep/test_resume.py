"""An interrupted sweep resumes: a sweep in a subprocess is stopped with Ctrl-C (SIGINT) once its first rows are in
the database; the same command run again finishes it. The final case set equals an uninterrupted run's, and no
case has two rows."""
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from cpumoe.bench.results import ResultsDB, case_key
from cpumoe.cli import main

SWEEP = ["bench", "sweep", "layer", "--skeleton", "qwen3-30b-a3b", "--skeleton-shape", "64,32,4,2",
         "--hidden", "64,128", "--inter", "32,64,96", "--num-experts", "4,8,16", "--top-k", "1,2", "--tokens", "1,4",
         "--experts", "fused,naive", "--threads", "1"]


def case_keys(path, *, read_only: bool = False) -> Counter:
    with ResultsDB(path, read_only=read_only) as db:
        return Counter(case_key(r.case) for r in db.rows("layer"))


def rows_so_far(path) -> int:
    """Rows the running sweep has committed, read without a write lock: a writer's open waits on the sweep's
    commits for it (sqlite's busy back-off), time in which a fast sweep could end before it was signalled."""
    try:
        return sum(case_keys(path, read_only=True).values())
    except ValueError:   # not there yet, or its table not yet made
        return 0


@pytest.mark.slow
def test_interrupted_sweep_resumes(tmp_path, capsys):
    interrupted = tmp_path / "interrupted.db"
    # A shell's background job starts with SIGINT ignored, and Python then keeps it ignored: give the sweep the
    # default disposition, so Ctrl-C reaches it however the tests were started.
    proc = subprocess.Popen([sys.executable, "-m", "cpumoe", *SWEEP, "--db", str(interrupted)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if rows_so_far(interrupted) >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the sweep ended before it could be interrupted:\n" + proc.stdout.read()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "run the same command to resume" in out, out
    first = case_keys(interrupted)
    total = 7 * 2 * 2   # the skeleton, H=128, I=64,96, E=8,16, k=1; x fused, naive; x M=1,4
    assert 2 <= sum(first.values()) < total and max(first.values()) == 1

    assert main(SWEEP + ["--db", str(interrupted)]) == 0
    out = capsys.readouterr().out
    assert f"{sum(first.values())} skipped" in out
    resumed = case_keys(interrupted)
    assert max(resumed.values()) == 1   # no case ran twice

    whole = tmp_path / "whole.db"
    assert main(SWEEP + ["--db", str(whole)]) == 0
    assert set(resumed) == set(case_keys(whole)) and len(resumed) == total
