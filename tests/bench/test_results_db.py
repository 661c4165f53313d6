"""The results database: rows kept as written, cases keyed by their parameters, resume by (bench, case, machine)."""
import sqlite3

import pytest

from cpumoe.bench.results import ResultsDB, case_key, fingerprint, machine_facts


def test_rows_round_trip_with_machine_and_limits(tmp_path):
    with ResultsDB(tmp_path / "r.db") as db:
        row_id = db.add("layer", {"tokens": 8, "preset": "x"}, {"time_ms": 1.5}, bandwidth_gbs=40.0, mm_gflops=900.0)
        (row,) = db.rows("layer")
    assert row.id == row_id and row.case == {"tokens": 8, "preset": "x"} and row.metrics == {"time_ms": 1.5}
    assert row.status == "ok" and row.bandwidth_gbs == 40.0 and row.mm_gflops == 900.0
    assert row.machine == fingerprint(machine_facts()) and row.machine_info["cores"] >= 1
    assert row.version and row.created > 0


def test_case_key_ignores_order():
    assert case_key({"a": 1, "b": [2, 3]}) == case_key({"b": [2, 3], "a": 1})
    assert case_key({"a": 1}) != case_key({"a": 2})


def test_done_counts_ok_and_oom_on_this_machine_only(tmp_path):
    with ResultsDB(tmp_path / "r.db") as db:
        db.add("sweep", {"i": 1}, {"message": "boom"}, status="error")
        assert not db.done("sweep", {"i": 1})      # an error is tried again
        db.add("sweep", {"i": 1}, {"bytes_needed": 10, "bytes_available": 5}, status="oom")
        assert db.done("sweep", {"i": 1})
        assert not db.done("other", {"i": 1})
        db.add("sweep", {"i": 2}, {}, machine_facts={"cpu": "elsewhere"})
        assert not db.done("sweep", {"i": 2}) and db.done("sweep", {"i": 2}, machine=fingerprint({"cpu": "elsewhere"}))


def test_a_case_run_again_appends_a_row(tmp_path):
    path = tmp_path / "r.db"
    with ResultsDB(path) as db:
        db.add("layer", {"m": 1}, {"t": 1.0})
        db.add("layer", {"m": 1}, {"t": 2.0})
        db.add("model", {"m": 2}, {"t": 3.0}, status="error")
    with ResultsDB(path) as db:   # reopened: the rows are on disk
        assert [r.metrics["t"] for r in db.rows("layer")] == [1.0, 2.0]
        assert [r.metrics["t"] for r in db.rows()] == [1.0, 2.0, 3.0]
        assert [r.bench for r in db.rows(status="error")] == ["model"]


def test_bad_status_and_bad_file_are_refused(tmp_path):
    with ResultsDB(tmp_path / "r.db") as db, pytest.raises(ValueError, match="status must be one of"):
        db.add("layer", {}, {}, status="fine")
    bad = tmp_path / "not.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ValueError, match="not a usable results database"):
        ResultsDB(bad)
    assert sqlite3.sqlite_version


def test_read_only_reads_and_never_writes(tmp_path):
    path = tmp_path / "r.db"
    with pytest.raises(ValueError, match="no such results database"):
        ResultsDB(path, read_only=True)
    assert not path.exists()
    with ResultsDB(path) as db:
        db.add("layer", {"m": 1}, {"t": 1.0})
    with ResultsDB(path, read_only=True) as db:
        assert [r.metrics for r in db.rows()] == [{"t": 1.0}]
        with pytest.raises(sqlite3.OperationalError):   # readonly database
            db.add("layer", {"m": 2}, {})
