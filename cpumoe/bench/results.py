"""Every benchmark's results in one SQLite database, so a study is kept, resumed and drawn.

One table, `results`, one row per measured (or refused) case, appended and never overwritten: a case run twice
has two rows, which is how a report shows a range over runs.

    bench          which benchmark: 'layer', 'model', 'serve', 'experts', 'prune', ...
    case_key       the case's parameters as canonical JSON (sorted keys): what makes a case this case
    status         'ok'; 'oom' (not run: it would not fit this machine; metrics has bytes_needed and
                   bytes_available); 'error' (metrics has the message)
    metrics        the measured values, JSON (per bench; see the bench's module)
    machine        the machine's fingerprint: a hash of its CPU model, features, cores and memory
    machine_json   what that hash is made of
    bandwidth_gbs  the read bandwidth and GEMM rate this run measured (NULL where it measured none): every
    mm_gflops      figure is read against the limits of the run it came from
    version        cpumoe's version, and the git commit of its source where it runs from a checkout
    git_commit
    created        unix time

A sweep skips a case that has an 'ok' or 'oom' row for the same bench, case and machine (`ResultsDB.done`), so a
sweep run again after an interruption picks up where it stopped. Only one process writes a database (a Ray sweep's
driver); sqlite3 from the standard library, nothing else.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import sqlite3
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

DEFAULT_DB = "cpumoe-results.db"   # under the current directory, unless $CPUMOE_RESULTS_DB names another
DONE_STATUSES = ("ok", "oom")     # a case with one of these is not run again by a sweep
STATUSES = ("ok", "oom", "error")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    id            INTEGER PRIMARY KEY,
    bench         TEXT NOT NULL,
    case_key      TEXT NOT NULL,
    status        TEXT NOT NULL,
    metrics       TEXT NOT NULL,
    machine       TEXT NOT NULL,
    machine_json  TEXT NOT NULL,
    bandwidth_gbs REAL,
    mm_gflops     REAL,
    version       TEXT NOT NULL,
    git_commit    TEXT,
    created       REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS results_case ON results (bench, case_key, machine);
"""


@dataclass(frozen=True, slots=True)
class Row:
    id: int
    bench: str
    case: dict[str, Any]
    status: str
    metrics: dict[str, Any]
    machine: str
    machine_info: dict[str, Any]
    bandwidth_gbs: float | None
    mm_gflops: float | None
    version: str
    git_commit: str | None
    created: float


def default_db() -> str:
    return os.environ.get("CPUMOE_RESULTS_DB") or DEFAULT_DB


def add_db_arguments(parser) -> None:
    """--db FILE and --no-db, as every benchmark that writes rows takes them."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--db", metavar="FILE", default=default_db(),
                       help=f"the results database rows are appended to (default $CPUMOE_RESULTS_DB or {DEFAULT_DB} "
                            "here)")
    group.add_argument("--no-db", action="store_true", help="write no rows to a results database")


def case_key(case: Mapping[str, Any]) -> str:
    """The canonical text of a case: the same parameters give the same key whatever their order."""
    return json.dumps(dict(case), sort_keys=True, separators=(",", ":"), default=str)


@functools.cache
def machine_facts() -> dict[str, Any]:
    """What identifies this machine for a benchmark: CPU model, the features cpumoe's kernels look at, cores, memory."""
    from cpumoe import ops
    from cpumoe.bench.machine import cpu_model

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu_model(), "features": sorted(ops.cpu_features()), "cores": os.cpu_count() or 1,
            "memory_gb": round(memory / 2**30)}


def fingerprint(facts: Mapping[str, Any]) -> str:
    return hashlib.sha256(case_key(facts).encode()).hexdigest()[:16]


@functools.cache
def source_commit() -> str | None:
    """The git commit cpumoe runs from (None when it is not a checkout, or git is missing)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


class ResultsDB:
    """The results database at `path` (created with its table if new). Use as a context manager, or close()."""

    def __init__(self, path: str | os.PathLike, *, read_only: bool = False) -> None:
        """read_only: open an existing database without writing to it (a report); a missing file is an error."""
        self.path = Path(path)
        try:
            if read_only:
                if not self.path.is_file():
                    raise ValueError(f"{self.path}: no such results database")
                self._db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
                self._db.execute("SELECT 1 FROM results LIMIT 1")
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(self.path, timeout=30)
                # A write-ahead log committed without an fsync per row: a sweep appends thousands of rows, and a
                # crash loses at most the last few (which a resumed sweep runs again).
                self._db.execute("PRAGMA journal_mode = WAL")
                self._db.execute("PRAGMA synchronous = NORMAL")
                self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as e:   # a file that is not a database, or one locked past the timeout
            raise ValueError(f"{self.path}: not a usable results database: {e}") from None
        self._facts = machine_facts()
        self.machine = fingerprint(self._facts)

    def __enter__(self) -> ResultsDB:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._db.close()

    def add(self, bench: str, case: Mapping[str, Any], metrics: Mapping[str, Any], *, status: str = "ok",
            bandwidth_gbs: float | None = None, mm_gflops: float | None = None,
            machine_facts: Mapping[str, Any] | None = None) -> int:
        """Append one case's row; returns its id. `machine_facts` is for rows measured on another machine (a Ray
        worker's); by default this machine's."""
        from cpumoe import __version__

        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        facts = dict(machine_facts) if machine_facts is not None else self._facts
        with self._db:
            cursor = self._db.execute(
                "INSERT INTO results (bench, case_key, status, metrics, machine, machine_json, bandwidth_gbs, "
                "mm_gflops, version, git_commit, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (bench, case_key(case), status, json.dumps(dict(metrics), default=_jsonable), fingerprint(facts),
                 case_key(facts), bandwidth_gbs, mm_gflops, __version__, source_commit(), time.time()))
        return cursor.lastrowid

    def done(self, bench: str, case: Mapping[str, Any], machine: str | None = None) -> bool:
        """Whether `case` already has an 'ok' or 'oom' row on this machine (or on `machine`): a sweep skips it."""
        found = self._db.execute(
            f"SELECT 1 FROM results WHERE bench = ? AND case_key = ? AND machine = ? AND status IN "
            f"({', '.join('?' * len(DONE_STATUSES))}) LIMIT 1",
            (bench, case_key(case), machine or self.machine, *DONE_STATUSES)).fetchone()
        return found is not None

    def rows(self, bench: str | None = None, *, status: str | None = None) -> list[Row]:
        """Every row, oldest first, of one bench (or all) and one status (or all)."""
        return list(self._select(bench, status))

    def _select(self, bench: str | None, status: str | None) -> Iterator[Row]:
        where, params = [], []
        if bench is not None:
            where.append("bench = ?")
            params.append(bench)
        if status is not None:
            where.append("status = ?")
            params.append(status)
        sql = ("SELECT id, bench, case_key, status, metrics, machine, machine_json, bandwidth_gbs, mm_gflops, version, "
               "git_commit, created FROM results" + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY id")
        for (id_, bench_, key, status_, metrics, machine, machine_json, bw, mm, version, commit,
             created) in self._db.execute(sql, params):
            yield Row(id=id_, bench=bench_, case=json.loads(key), status=status_, metrics=json.loads(metrics),
                      machine=machine, machine_info=json.loads(machine_json), bandwidth_gbs=bw, mm_gflops=mm,
                      version=version, git_commit=commit, created=created)


def _jsonable(value: Any) -> Any:
    """numpy / torch scalars and other odd values in metrics, as JSON takes them."""
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
