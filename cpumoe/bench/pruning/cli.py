"""The parser of `cpumoe ... prune` (argparse only: the handler imports what it runs)."""
from __future__ import annotations


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("prune", help="the pruning sweep (not built yet)")
    p.set_defaults(func=_not_built)


def _not_built(args) -> int:
    raise SystemExit("cpumoe: this command is not built yet")
