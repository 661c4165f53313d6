"""The parser of `cpumoe bench throughput` (argparse only: the handler imports what it runs).

    cpumoe bench throughput MODEL [--num-prompts 32] [--max-concurrency 16] [--input-len 512] [--output-len 128]
                                  [--max-num-batched-tokens 256,512,2048] [--repeats 1] [--quick] [--json FILE]
"""
from __future__ import annotations

import sys

from cpumoe.cli_args import positive_int, positive_ints

PROG = "cpumoe bench throughput"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("throughput", help="the offline engine under a serving load (C requests in flight): "
                                                 "throughput, TTFT, TPOT and where the steps' time goes, per step "
                                                 "budget")
    p.add_argument("model", metavar="MODEL", help="a local Hugging Face checkpoint directory")
    p.add_argument("--num-prompts", type=positive_int, default=32, help="requests (default 32)")
    p.add_argument("--max-concurrency", type=positive_int, default=16, help="requests in flight at most (default 16)")
    p.add_argument("--input-len", type=positive_int, default=512, help="random prompt tokens (default 512)")
    p.add_argument("--output-len", type=positive_int, default=128, help="tokens per request (default 128)")
    p.add_argument("--max-num-batched-tokens", type=positive_ints, default=None, metavar="N,N",
                   help="step budgets to compare, in turn (default: cpumoe serve's)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (default 1, vllm bench serve's); 0 is greedy")
    p.add_argument("--repeats", type=positive_int, default=1, help="repetitions of every budget, in turn (default 1)")
    p.add_argument("--seed", type=int, default=0, help="the random prompts (default 0)")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), help="model dtype (default: the checkpoint's)")
    p.add_argument("--quick", action="store_true",
                   help="smaller probes for the step floors (a 256 MiB read, a 1024^3 mm): smoke runs")
    p.add_argument("--json", metavar="FILE", help="also write every run as JSON")
    p.set_defaults(func=_cmd_throughput)


def _cmd_throughput(args) -> int:
    import dataclasses
    import json
    from pathlib import Path

    import torch

    from cpumoe.bench.model import engine_config
    from cpumoe.bench.throughput import Load, load_case, render_throughput_report, run_throughput_bench
    from cpumoe.cli_args import stdout_console
    from cpumoe.engine.config import EngineConfig
    from cpumoe.engine.engine import LLMEngine
    from cpumoe.loader import CheckpointError

    if args.temperature < 0:
        sys.exit(f"{PROG}: error: --temperature must be >= 0")
    load = Load(args.num_prompts, args.max_concurrency, args.input_len, args.output_len, args.temperature, args.seed)
    budgets = args.max_num_batched_tokens or [EngineConfig().max_num_batched_tokens]
    # KV room for every request, whole, and no prefix caching (no run reuses another's prompts); at most
    # max_concurrency are in flight, which run_load keeps to
    config = engine_config([load_case(load)])
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16, None: None}[args.dtype]
    try:
        engine = LLMEngine(args.model, dtype=dtype, config=config)  # its tokenizer too: serving detokenizes
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        sys.exit(f"{PROG}: error: {e}")
    console = stdout_console()

    def progress(r) -> None:
        console.print(f"budget {r.max_num_batched_tokens}, run {r.repeat + 1}: {r.output_tok_s:.1f} output tok/s "
                      f"in {r.duration_s:.1f} s")

    results = run_throughput_bench(engine, load, budgets, args.repeats, on_result=progress, quick=args.quick)
    console.print(render_throughput_report(results, load, Path(args.model).name))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(args.model), "load": dataclasses.asdict(load),
                                               "results": [dict(dataclasses.asdict(r), bound_tok_s=r.bound_tok_s)
                                                           for r in results]}, indent=1))
    return 0
