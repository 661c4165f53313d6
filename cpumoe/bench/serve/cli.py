"""The parser of `cpumoe bench serve` (argparse only: the handler imports what it runs)."""
from __future__ import annotations

import argparse
import math
import sys

from cpumoe.cli_args import positive_float, positive_int

PROG = "cpumoe bench serve"
SLO_NAMES = ("ttft", "tpot", "e2el")


def _rates(text: str) -> list[float]:
    rates = []
    for part in (p.strip() for p in text.split(",")):
        try:
            rate = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers or inf, got {text!r}") from None
        if math.isnan(rate) or rate <= 0:
            raise argparse.ArgumentTypeError(f"a request rate must be positive (or inf), got {part!r}")
        rates.append(rate)
    return rates


def _length(text: str):
    from cpumoe.bench.serve.datasets import LengthRange
    try:
        return LengthRange.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _slo(text: str) -> tuple[str, float]:
    name, _, value = text.partition(":")
    if name not in SLO_NAMES:
        raise argparse.ArgumentTypeError(f"expected NAME:MS with NAME one of {', '.join(SLO_NAMES)}, got {text!r}")
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME:MS with a number of ms, got {text!r}") from None
    if not (ms > 0 and math.isfinite(ms)):
        raise argparse.ArgumentTypeError(f"an SLO must be a positive number of ms, got {text!r}")
    return name, ms


def add_parser(subparsers) -> None:
    from cpumoe.bench.results import add_db_arguments

    p = subparsers.add_parser(
        "serve", help="load an OpenAI-compatible server (cpumoe, vLLM, llama-server) and report its latencies",
        description="Stream requests to an OpenAI-compatible server on a Poisson (or gamma) arrival schedule and "
                    "report throughput, TTFT, TPOT, ITL and E2E latency as `vllm bench serve` defines them.")
    p.add_argument("--base-url", metavar="URL", default="http://127.0.0.1:8000",
                   help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--model", metavar="NAME",
                   help="the model name to send (default: the first of the server's /v1/models)")
    p.add_argument("--api-key", metavar="KEY", help="sent as a Bearer token")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    p.add_argument("--dataset", metavar="random|FILE", default="random",
                   help='"random" (default) or a JSONL file: one object a line with "prompt" (or "messages" for '
                        'chat) and an optional "output_len"')
    p.add_argument("--tokenizer", metavar="PATH",
                   help="a Hugging Face tokenizer directory or tokenizer.json: makes and counts the random prompts, "
                        "counts output where the server sends no usage (default: --model, when it is a directory)")
    p.add_argument("--input-len", metavar="N|LO:HI", type=_length, default=_length("512"),
                   help="random prompts' tokens: N, or LO:HI drawn uniformly per request (default 512)")
    p.add_argument("--output-len", metavar="N|LO:HI", type=_length, default=_length("128"),
                   help="tokens asked per request: N or LO:HI (default 128; a JSONL line's output_len wins)")
    p.add_argument("--num-prompts", metavar="N", type=positive_int, default=100,
                   help="requests per rate (default 100)")
    p.add_argument("--request-rate", metavar="R[,R...]", type=_rates, default=[math.inf],
                   help="requests/s, or inf for all at once (default); comma-separated for a sweep: 1,2,4,inf")
    p.add_argument("--burstiness", metavar="K", type=positive_float, default=1.0,
                   help="gamma shape of the inter-arrival times (1: Poisson, default; <1 burstier; >1 steadier)")
    p.add_argument("--max-concurrency", metavar="C", type=positive_int,
                   help="requests in flight at most (default: no limit)")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default 0)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos and min_tokens (for servers that reject them)")
    p.add_argument("--goodput", type=_slo, nargs="+", metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    p.add_argument("--label", metavar="NAME",
                   help="the server's name in the results (default: host:port of --base-url)")
    p.add_argument("--json", metavar="FILE", help="write the run as vLLM's --save-result does (a list for a sweep)")
    p.add_argument("--request-timeout", metavar="S", type=positive_float, default=6 * 3600.0,
                   help="seconds a request may take (default 21600)")
    p.add_argument("--no-ceiling", action="store_true", help="skip measuring the client's ceiling (~1 s)")
    add_db_arguments(p)
    p.set_defaults(func=_cmd_bench_serve)


def _fail(message: str):
    sys.exit(f"{PROG}: error: {message}")


def _base_url(text: str) -> str:
    from urllib.parse import urlsplit

    url = text.rstrip("/").removesuffix("/v1")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        _fail(f"--base-url must be http://HOST:PORT or https://..., got {text!r}")
    try:
        parts.port
    except ValueError:
        _fail(f"--base-url has a bad port: {text!r}")
    return url


def _cmd_bench_serve(args) -> int:
    import asyncio
    import json
    from pathlib import Path
    from urllib.parse import urlsplit

    from cpumoe.bench.serve import run
    from cpumoe.bench.serve.client import Target, list_models
    from cpumoe.bench.serve.datasets import Tokenizer
    from cpumoe.bench.serve.report import print_report
    from cpumoe.cli_args import stdout_console

    base_url = _base_url(args.base_url)
    goodput = dict(args.goodput) if args.goodput else None
    if args.dataset != "random" and not Path(args.dataset).is_file():
        _fail(f"--dataset must be random or a JSONL file; {args.dataset} is not a file")
    console = stdout_console()

    tokenizer = None
    tokenizer_path = args.tokenizer
    if tokenizer_path is None and args.model and Path(args.model).is_dir():
        tokenizer_path = args.model   # a local model directory names its tokenizer, as in vLLM
    if tokenizer_path is not None:
        try:
            tokenizer = Tokenizer(tokenizer_path)
        except ValueError as e:
            _fail(f"--tokenizer: {e}")

    try:
        models = asyncio.run(list_models(base_url, args.api_key))
    except ConnectionError as e:
        _fail(f"{e} (is the server running? check --base-url)")
    except ValueError as e:
        if args.model is None:
            _fail(f"{e}; pass --model")
        models = []
        console.print(f"warning: {e}", style="yellow", highlight=False, markup=False)
    if args.model is None and not models:
        _fail(f"{base_url}/v1/models lists no model; pass --model")
    model = args.model or models[0]

    target = Target(base_url=base_url, model=model, endpoint=args.endpoint, api_key=args.api_key,
                    ignore_eos=not args.no_ignore_eos, timeout_s=args.request_timeout)
    label = args.label or urlsplit(base_url).netloc
    bench = run.ServeBench(target=target, label=label, dataset=args.dataset, input_len=args.input_len,
                           output_len=args.output_len, num_prompts=args.num_prompts,
                           request_rates=tuple(args.request_rate), burstiness=args.burstiness,
                           max_concurrency=args.max_concurrency, seed=args.seed, goodput=goodput,
                           tokenizer=tokenizer.name if tokenizer else None)
    try:   # every rate's prompts before any clock starts
        prompt_sets = [run.make_prompts(bench, tokenizer, i) for i in range(len(bench.request_rates))]
    except ValueError as e:
        _fail(str(e))

    ceiling = None
    if not args.no_ceiling:
        from cpumoe.bench.serve.ceiling import client_ceiling
        ceiling = client_ceiling().chunks_per_s

    results = []
    for rate, prompts in zip(bench.request_rates, prompt_sets):
        console.print(f"rate {rate:g} req/s: {len(prompts)} requests to {target.url} ...", highlight=False)
        results.append(run.run_rate(bench, prompts, rate, tokenizer))
    prompt_warnings = run.prompt_warnings([p for prompts in prompt_sets for p in prompts])
    print_report(console, bench, results, ceiling, prompt_warnings)

    files = [run.result_json(bench, r) for r in results]
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(files[0] if len(files) == 1 else files, indent=2) + "\n")
        except OSError as e:
            _fail(f"--json {args.json}: cannot write it: {e}")
        console.print(f"wrote {args.json}", highlight=False)
    if not args.no_db:
        _write_rows(args.db, bench, results, files, ceiling)
    return 0 if any(r.metrics["completed"] for r in results) else 1


def _write_rows(path: str, bench, results, files, ceiling: float | None) -> None:
    from cpumoe.bench.results import ResultsDB
    from cpumoe.bench.serve import run

    try:
        db = ResultsDB(path)
    except ValueError as e:
        _fail(f"--db: {e}")
    with db:
        for result, file in zip(results, files):
            mismatched = sum(o.success and o.output_tokens != o.asked_output_len for o in result.outputs)
            extra = {"client_ceiling_chunks_s": ceiling, "output_len_mismatches": mismatched,
                     "output_len_sources": result.output_len_sources}
            errors = result.errors()
            if errors:
                extra["first_errors"] = [f"{n} x {message}" for message, n in errors[:run.SHOWN_ERRORS]]
            status = "ok" if result.metrics["completed"] else "error"
            db.add("serve", run.db_case(bench, result.request_rate), run.db_metrics(file, extra), status=status)
