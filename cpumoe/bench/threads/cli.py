"""The parser of `cpumoe bench threads` (argparse only: the handler imports what it runs).

    cpumoe bench threads [MODEL] [--threads 1,2,4,8,16] [--tokens 1,16] [--batch 1,16] [--input-len 128]
                         [--output-len 32] [--repeats 1] [--quick] [--json FILE]
"""
from __future__ import annotations

import os
import sys

from cpumoe.cli_args import positive_int, positive_ints

PROG = "cpumoe bench threads"


def default_threads() -> list[int]:
    """1, 2, 4, ... up to this machine's cores, and the cores themselves."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    counts = [1 << i for i in range(cores.bit_length()) if 1 << i <= cores]
    return counts + ([cores] if counts[-1] != cores else [])


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("threads", help="the fused experts op (and, given a checkpoint, its decode step) at "
                                              "several thread counts: scaling against the read probe's")
    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="a local Hugging Face checkpoint directory whose decode step to time too (default: the "
                        "experts op alone)")
    p.add_argument("--preset", default="qwen3-30b-a3b", help="the experts layer's shape (default qwen3-30b-a3b)")
    p.add_argument("--threads", type=positive_ints, default=None, metavar="N,N",
                   help="thread counts (default 1, 2, 4, ... up to this machine's cores)")
    p.add_argument("--tokens", type=positive_ints, default=[1, 16], help="experts op token counts (default 1,16)")
    p.add_argument("--batch", type=positive_ints, default=[1, 16], help="decode batch sizes (default 1,16)")
    p.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--output-len", type=positive_int, default=32, help="decoded tokens per request (default 32)")
    p.add_argument("--repeats", type=positive_int, default=1, help="bench model repetitions per count (default 1)")
    p.add_argument("--quick", action="store_true", help="bench layer's --quick (1-3 repetitions, a smaller probe)")
    p.add_argument("--json", metavar="FILE", help="also write the table's data here")
    p.set_defaults(func=_cmd_threads)


def _cmd_threads(args) -> int:
    import json
    import subprocess

    from rich.console import Console

    from cpumoe.bench.threads import render_thread_scaling, run_thread_scaling
    from cpumoe.cli_args import stdout_console
    from cpumoe.presets import get_preset

    progress = Console(stderr=True)
    try:
        report = run_thread_scaling(args.model, get_preset(args.preset), args.threads or default_threads(),
                                    tokens=args.tokens, batches=args.batch, input_len=args.input_len,
                                    output_len=args.output_len, repeats=args.repeats, quick=args.quick,
                                    on_step=lambda what: progress.print(f"[dim]{what}[/]"))
    except subprocess.CalledProcessError as e:
        sys.exit(f"{PROG}: error: {' '.join(e.cmd[1:])} failed:\n{e.stderr}")
    except ValueError as e:   # an unknown preset, or no backend here runs it
        sys.exit(f"{PROG}: error: {e}")
    console = stdout_console()
    render_thread_scaling(report, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"results written to {args.json}")
    return 0
