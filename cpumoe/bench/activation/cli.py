"""The parser of `cpumoe bench experts` (argparse only: the handler imports what it runs).

    cpumoe bench experts MODEL [--prompts FILE | --random-tokens N] [--batch-sizes 1,2,..] [--out heatmap.png]
"""
from __future__ import annotations

import sys

from cpumoe.bench.results import add_db_arguments
from cpumoe.cli_args import positive_int, positive_ints

PROG = "cpumoe bench experts"
DEFAULT_RANDOM_TOKENS = 2048


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("experts", help="which experts a prompt set routes to: heatmap, load imbalance, "
                                              "distinct experts per batch")
    p.add_argument("model", metavar="MODEL", help="a local Hugging Face checkpoint directory")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompts", metavar="FILE",
                        help="a text file, one prompt per non-empty line (lines longer than --max-len tokens are cut "
                             "into chunks); needs the checkpoint's tokenizer")
    source.add_argument("--random-tokens", type=positive_int, metavar="N",
                        help="N random token ids instead (default when no --prompts: 2048)")
    p.add_argument("--max-len", type=positive_int, default=512, help="tokens per routed sequence (default 512)")
    p.add_argument("--batch-sizes", type=positive_ints, default=[1, 2, 4, 8, 16, 32, 64], metavar="B,B",
                   help="batch sizes for the distinct-experts table (default 1,2,4,8,16,32,64)")
    p.add_argument("--out", default="experts-heatmap.png", metavar="PNG",
                   help="the layer x expert heatmap (default experts-heatmap.png)")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), help="model dtype (default: the checkpoint's)")
    add_db_arguments(p)
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.set_defaults(func=_cmd_experts)


def _cmd_experts(args) -> int:
    import json

    import torch
    from rich.console import Console

    from cpumoe.bench.activation.heatmap import draw_heatmap
    from cpumoe.bench.activation.run import experts_report, model_name, render_experts_report
    from cpumoe.bench.activation.tokens import token_set
    from cpumoe.bench.results import ResultsDB
    from cpumoe.loader import CheckpointError
    from cpumoe.models import load_model

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}.get(args.dtype)
    console = Console() if Console().is_terminal else Console(width=160)
    try:
        model = load_model(args.model, dtype=dtype)
        random = None if args.prompts else args.random_tokens or DEFAULT_RANDOM_TOKENS
        tokens = token_set(args.model, model.config.vocab_size, text=args.prompts, random=random, max_len=args.max_len)
        report = experts_report(model, tokens, name=model_name(args.model), batches=args.batch_sizes)
        db = None if args.no_db else ResultsDB(args.db)
    except (CheckpointError, ValueError, OSError) as e:
        sys.exit(f"{PROG}: error: {e}")
    skipped = [B for B in args.batch_sizes if B not in report.distinct_batches]
    render_experts_report(report, console, skipped)
    png = draw_heatmap(torch.tensor(report.counts), report.layers, args.out,
                       title=f"{report.model}: tokens per layer and expert ({report.tokens} tokens, {report.source})")
    console.print(f"heatmap: {png}")
    if db is not None:
        with db:
            db.add("experts", report.case, report.metrics)
        console.print(f"[dim]one 'experts' row in {args.db}[/]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"case": report.case, "metrics": report.metrics}, f, indent=1)
    return 0
