"""The parser of `cpumoe ... report` (argparse only: the handler imports what it runs)."""
from __future__ import annotations


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="a results database as an HTML page (not built yet)")
    p.set_defaults(func=_not_built)


def _not_built(args) -> int:
    raise SystemExit("cpumoe: this command is not built yet")
