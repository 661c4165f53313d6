"""The parser of `cpumoe prune` (argparse only: the handler imports what it runs).

    cpumoe prune MODEL OUT --method inter|intra --ratio R [--calibration FILE | --calibration-random N]
"""
from __future__ import annotations

import argparse
import sys

from cpumoe.cli_args import positive_int

PROG = "cpumoe prune"
DEFAULT_CALIBRATION_TOKENS = 2048


def ratio(text: str) -> float:
    """A pruning ratio in (0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"the ratio must be in (0, 1) (e.g. 0.125, 0.25, 0.5), got {text}")
    return value


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("prune", help="write a pruned checkpoint: drop experts (inter) or shrink them (intra)")
    p.add_argument("model", metavar="MODEL", help="a local per-expert float checkpoint directory")
    p.add_argument("out", metavar="OUT", help="the pruned checkpoint's directory (new or empty)")
    p.add_argument("--method", required=True, choices=("inter", "intra"),
                   help="inter: drop the least-chosen experts of every MoE layer and their router rows; intra: drop "
                        "each expert's lowest-norm intermediate channels")
    p.add_argument("--ratio", required=True, type=ratio, help="share of experts (inter) or channels (intra) to drop")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--calibration", metavar="FILE",
                        help="inter: routing counts from this text file (one prompt per non-empty line)")
    source.add_argument("--calibration-random", type=positive_int, metavar="N",
                        help=f"inter: routing counts from N random tokens (default {DEFAULT_CALIBRATION_TOKENS})")
    p.add_argument("--max-len", type=positive_int, default=512, help="tokens per calibration sequence (default 512)")
    p.set_defaults(func=_cmd_prune)


def _cmd_prune(args) -> int:
    from rich.console import Console

    from cpumoe.loader import CheckpointError
    from cpumoe.prune.calibration import calibration_counts
    from cpumoe.prune.checkpoint import check_prunable, prune_checkpoint

    console = Console() if Console().is_terminal else Console(width=160)
    try:
        check_prunable(args.model)  # refuse before a calibration pass
        counts, note = None, ""
        if args.method == "inter":
            random = None if args.calibration else args.calibration_random or DEFAULT_CALIBRATION_TOKENS
            counts, name, tokens = calibration_counts(args.model, text=args.calibration, random=random,
                                                      max_len=args.max_len)
            note = f", routing counts of {tokens} calibration tokens ({name})"
        elif args.calibration or args.calibration_random:
            note = " (intra-expert pruning uses weight norms: the calibration set is not used)"
        result = prune_checkpoint(args.model, args.out, method=args.method, ratio=args.ratio, counts=counts)
    except (CheckpointError, ValueError, OSError) as e:
        sys.exit(f"{PROG}: error: {e}")
    if args.method == "inter":
        console.print(f"{result.out}: {result.experts[0]} -> {result.experts[1]} experts per MoE layer{note}")
        for layer, dropped in result.dropped_experts.items():
            console.print(f"  layer {layer}: dropped experts {dropped}")
    else:
        console.print(f"{result.out}: expert intermediate size {result.inter_size[0]} -> {result.inter_size[1]} "
                      f"(lowest ||gate|| x ||up|| x ||down|| channels dropped){note}")
    console.print(f"routed expert parameters: {result.expert_params:,}")
    return 0
