"""The parser of `cpumoe ... report` (argparse only: the handler imports what it runs).

    cpumoe report [--db FILE] [--out DIR] [--skeleton H,I,E,k] [--title TEXT]
writes DIR/index.html (open it in any browser: no script, no network), DIR/figures/*.png, DIR/tables.md and
DIR/csv/<table>.csv from the rows of a results database.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_OUT = "cpumoe-report"


def add_parser(subparsers) -> None:
    from cpumoe.bench.results import DEFAULT_DB, default_db

    p = subparsers.add_parser("report", help="a results database as one static HTML page, with Markdown and CSV",
                              description="Draw a results database as one static HTML page (PNG figures, tables "
                                          "with median and range over runs) plus tables.md and csv/<table>.csv.")
    p.add_argument("--db", default=default_db(),
                   help=f"the results database to read (default $CPUMOE_RESULTS_DB or {DEFAULT_DB} here)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"the directory to write the page into (default {DEFAULT_OUT})")
    p.add_argument("--skeleton", type=_skeleton, default=None, metavar="H,I,E,k",
                   help="the layer shape the sweeps vary one parameter of (default: the most common among the rows)")
    p.add_argument("--title", default="cpumoe benchmark report", help="the page's title")
    p.set_defaults(func=_cmd_report)


def _skeleton(text: str):
    from cpumoe.report.cases import Skeleton
    try:
        return Skeleton.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _cmd_report(args) -> int:
    db_path, out_dir = Path(args.db), Path(args.out)
    if not db_path.exists():
        sys.exit(f"cpumoe report: error: no results database at {db_path} (run a benchmark first, or pass --db FILE)")
    if not db_path.is_file():
        sys.exit(f"cpumoe report: error: {db_path} is not a file")
    if out_dir.exists() and not out_dir.is_dir():
        sys.exit(f"cpumoe report: error: --out {out_dir} exists and is not a directory")

    from cpumoe.report.write import write_report

    try:
        written = write_report(db_path, out_dir, skeleton=args.skeleton, title=args.title)
    except ValueError as e:   # a file that is not a results database
        sys.exit(f"cpumoe report: error: {e}")
    print(f"{written.index}: {written.rows} rows, {written.figures} figures, {written.tables} tables "
          f"(tables.md, csv/ beside it)")
    return 0
