"""The parser of `cpumoe bench prune` (argparse only: the handler imports what it runs).

    cpumoe bench prune MODEL [--methods inter,intra] [--ratios 0.125,0.25,0.5] [--text FILE]
"""
from __future__ import annotations

import argparse
import sys

from cpumoe.bench.results import add_db_arguments
from cpumoe.cli_args import positive_int, unique_names

PROG = "cpumoe bench prune"


def _methods(text: str) -> list[str]:
    methods = unique_names(text)
    if not methods or any(m not in ("inter", "intra") for m in methods):
        raise argparse.ArgumentTypeError(f"expected methods inter and/or intra, got {text!r}")
    return methods


def _ratios(text: str) -> list[float]:
    from cpumoe.prune.cli import ratio
    values = [ratio(v.strip()) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated ratios, got {text!r}")
    return values


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("prune", help="the pruning sweep: speed and quality of pruned copies against the "
                                            "unpruned model")
    p.add_argument("model", metavar="MODEL", help="a local per-expert float checkpoint directory")
    p.add_argument("--methods", type=_methods, default=["inter", "intra"], help="inter,intra (default both)")
    p.add_argument("--ratios", type=_ratios, default=[0.125, 0.25, 0.5], help="default 0.125,0.25,0.5")
    p.add_argument("--text", metavar="FILE", help="evaluation text, one prompt per non-empty line (default: "
                                                  "random tokens, said so in the report)")
    p.add_argument("--eval-tokens", type=positive_int, default=256,
                   help="random evaluation tokens without --text (default 256)")
    p.add_argument("--calibration", metavar="FILE", help="calibration text for inter-pruning's routing counts "
                                                         "(default: random tokens)")
    p.add_argument("--calibration-random", type=positive_int, default=2048, metavar="N",
                   help="random calibration tokens without --calibration (default 2048)")
    p.add_argument("--max-len", type=positive_int, default=256, help="tokens per evaluated sequence (default 256)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch of the speed case (default 1)")
    p.add_argument("--input-len", type=positive_int, default=128, help="prompt length of the speed case (default 128)")
    p.add_argument("--output-len", type=positive_int, default=32, help="output length of the speed case (default 32)")
    p.add_argument("--repeats", type=positive_int, default=3, help="measured runs of the speed case, median "
                                                                    "(default 3)")
    p.add_argument("--quick", action="store_true", help="quicker machine limits (a 256 MiB bandwidth probe, a 1024^3 "
                                                        "mm)")
    p.add_argument("--work-dir", metavar="DIR", help="where each pruned copy is written and removed after its case "
                                                     "(default: the system's temporary directory)")
    add_db_arguments(p)
    p.set_defaults(func=_cmd_prune_sweep)


def _cmd_prune_sweep(args) -> int:
    from rich.console import Console

    from cpumoe.bench.activation.run import model_name
    from cpumoe.bench.pruning.sweep import SweepConfig, render_sweep, run_prune_sweep
    from cpumoe.bench.results import ResultsDB
    from cpumoe.loader import CheckpointError

    console = Console() if Console().is_terminal else Console(width=160)
    config = SweepConfig(methods=args.methods, ratios=args.ratios, text=args.text, eval_tokens=args.eval_tokens,
                         calibration=args.calibration, calibration_tokens=args.calibration_random,
                         max_len=args.max_len, batch=args.batch, input_len=args.input_len,
                         output_len=args.output_len, repeats=args.repeats, quick=args.quick,
                         work_dir=args.work_dir)
    name = model_name(args.model)
    try:
        db = None if args.no_db else ResultsDB(args.db)
        rows, described = run_prune_sweep(args.model, config, progress=console)
    except (CheckpointError, ValueError, OSError) as e:
        sys.exit(f"{PROG}: error: {e}")
    render_sweep(rows, console, title=f"{name}: pruning sweep, quality on {described}; speed: batch {args.batch}, "
                                      f"input {args.input_len}, output {args.output_len}")
    if db is not None:
        with db:
            for r in rows:
                db.add("prune", {"model": name, "method": r.method, "ratio": r.ratio}, r.metrics, status=r.status,
                       bandwidth_gbs=r.metrics.get("bandwidth_gbs"), mm_gflops=r.metrics.get("mm_gflops"))
        console.print(f"[dim]{len(rows)} 'prune' rows in {args.db}[/]")
    return 0
