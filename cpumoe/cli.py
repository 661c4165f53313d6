"""The `cpumoe` command.

    cpumoe info [--preset P] [--dtype bf16] [--quant int8,..]  this CPU, the experts backends, which one a layer gets
    cpumoe bench layer --preset P --tokens 1,8,.. [--dtype bf16,int8,..]  time one MoE layer per format and backend
    cpumoe make-model --preset P --layers N --out D  write a synthetic Hugging Face checkpoint of a real model
    cpumoe quantize SRC DST --format F [--layout L]  a float checkpoint -> a public quantized layout
    cpumoe generate MODEL --prompt TEXT [--chat]    stream a completion from a local checkpoint, then tokens/s
    cpumoe serve MODEL [--host H --port P --api-key K]  an OpenAI-compatible server (/v1/completions, /v1/chat/...)
    cpumoe bench serve|sweep|experts|prune ...      the benchmark suite (each writes rows to a results database)
    cpumoe prune MODEL OUT --method inter|intra --ratio R  a pruned checkpoint
    cpumoe report --db FILE --out DIR               an HTML page of a results database's figures and tables

The suite's commands live beside what they run (cpumoe/bench/*, cpumoe/prune, cpumoe/report): each module gives an
`add_parser(subparsers)` that builds its parser and imports nothing heavy until its handler runs.

Each subcommand is a parser built by `_add_<name>` and a handler `_cmd_<name>(args) -> exit code`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cpumoe.bench.results import add_db_arguments
from cpumoe.cli_args import names, positive_int, positive_ints, stdout_console, weight_formats
from cpumoe.engine.config import EngineConfig
from cpumoe.server import limits

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}
DEFAULT_PRESET = "qwen3-30b-a3b"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpumoe", description="Mixture-of-Experts inference on CPUs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_info(commands)
    _add_bench(commands)
    _add_make_model(commands)
    _add_quantize(commands)
    _add_generate(commands)
    _add_serve(commands)
    from cpumoe.prune.cli import add_parser as add_prune
    from cpumoe.report.cli import add_parser as add_report
    add_prune(commands)
    add_report(commands)
    return parser


# ---- argument types ---------------------------------------------------------------------------------------------

def _preset(name: str):
    from cpumoe.presets import get_preset
    try:
        return get_preset(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose from bf16, fp32, fp16")
    return DTYPES[name]


def _quant_formats(text: str) -> list[str]:
    from cpumoe.quant import parse_format
    try:
        return list(dict.fromkeys(parse_format(name).value for name in names(text)))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative(text: str):
    from cpumoe.engine.config import SpeculativeConfig
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


BATCH_INVARIANT_HELP = ("a request's tokens never depend on the other requests in its steps or on how its prompt "
                        "is chunked: attention runs every token as a row of its own")
SPECULATIVE_HELP = ('speculative decoding, as vLLM\'s flag takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                    '"prompt_lookup_max": 3}\' or \'{"method": "draft", "model": DIR, "num_speculative_tokens": 4}\'')


# ---- cpumoe info ------------------------------------------------------------------------------------------------

def _add_info(commands) -> None:
    p = commands.add_parser("info", help="this CPU, the experts backends, and which one a layer gets")
    p.add_argument("--preset", type=_preset, default=DEFAULT_PRESET, help=f"layer preset (default {DEFAULT_PRESET})")
    p.add_argument("--dtype", type=_dtype, default=torch.bfloat16, help="bf16 (default), fp32 or fp16")
    p.add_argument("--quant", type=_quant_formats, default=None,
                   help="quantized formats to ask the oracle about, comma-separated (default: all of int8_w8a8, "
                        "int4_w4a16, fp8_w8a16, mxfp4_w4a16; aliases int8, int4, fp8, mxfp4)")
    p.add_argument("--group-size", type=int, default=128, help="int4 group / fp8 k block (default 128)")
    p.set_defaults(func=_cmd_info)


def _cmd_info(args) -> int:
    from cpumoe import __version__, ops
    from cpumoe.bench.layer import experts_config
    from cpumoe.bench.machine import cpu_model
    from cpumoe.experts import all_backends, backend_report, choose_backend
    from cpumoe.memory import huge_page_advice

    console = stdout_console()
    console.print(f"[bold]cpumoe[/] {__version__}   torch {torch.__version__}   threads {torch.get_num_threads()} "
                  f"(kernels on cpumoe's worker pool; torch's ops on OpenMP, GOMP_SPINCOUNT "
                  f"{os.environ.get('GOMP_SPINCOUNT', 'unset')})")
    console.print(f"[bold]CPU[/] {cpu_model()}")
    console.print(f"[bold]features[/] {' '.join(ops.cpu_features()) or '(none detected)'}")
    console.print(_backends_table(all_backends()))
    attention = ops.attention_backends()
    console.print(f"[bold]decode attention[/] runs on [bold]{attention[0]}[/] (the first backend with an attention "
                  f"kernel; candidates here: {', '.join(attention)})")
    if scope := ops.attention_scope(attention[0]):
        console.print(f"  {attention[0]} {scope}")
    if prefill_backend := ops.prefill_attention_backend():
        console.print(f"[bold]prefill attention[/] runs on [bold]{prefill_backend}[/] where it takes the chunk, else "
                      "the blocked torch maths (float32: "
                      f"{escape(ops.prefill_attention_refusal(torch.float32, 128, 128))})")
    else:
        console.print("[bold]prefill attention[/] runs the blocked torch maths "
                      f"({escape(ops.prefill_attention_refusal(torch.bfloat16, 128, 128))})")
    console.print("[bold]huge pages[/] the packed weights and the KV cache ask for 2 MB pages; "
                  f"{escape(huge_page_advice())}")

    preset, dtype = args.preset, args.dtype
    config = experts_config(preset, dtype)
    chosen = choose_backend(config).name
    console.print(f"\n[bold]{preset.name}[/] H={preset.hidden} I={preset.inter} E={preset.experts} k={preset.top_k} "
                  f"{str(dtype).removeprefix('torch.')} {preset.activation}: the oracle chooses [bold]{chosen}[/]")
    console.print(_choice_table(backend_report(config), chosen))
    return _info_quantized(console, preset, args.quant, args.group_size)


def _info_quantized(console: Console, preset, format_names: list[str] | None, group_size: int) -> int:
    """For each quantized format (bf16 activations): the oracle's choice for the layer and every backend's reason."""
    from cpumoe.bench.layer import check_format, experts_config, parse_weight_format
    from cpumoe.experts import NoSupportedBackend, all_backends, backend_report, choose_backend
    from cpumoe.quant import QuantFormat

    if group_size < 1:
        sys.exit("cpumoe info: error: --group-size must be positive")
    formats = [parse_weight_format(name, group_size) for name in (format_names or [f.value for f in QuantFormat])]
    table = Table(title=f"{preset.name}, quantized weights over bf16 activations: every backend's verdict",
                  title_justify="left")
    table.add_column("backend", no_wrap=True)
    for fmt in formats:
        table.add_column(fmt.name)
    verdicts: dict[str, list[str]] = {p.name: [] for p in all_backends()}
    for fmt in formats:
        try:
            check_format(preset, fmt)
        except ValueError as e:   # a shape the format's groups cannot take
            console.print(f"[bold]{fmt.describe()}[/]: [yellow]{e}[/]")
            for cells in verdicts.values():
                cells.append("-")
            continue
        config = experts_config(preset, fmt)
        try:
            chosen = choose_backend(config).name
        except NoSupportedBackend:
            chosen = None
        report = backend_report(config)
        console.print(f"[bold]{fmt.describe()}[/]: the oracle chooses [bold]{chosen or 'no backend'}[/]")
        for name, ok, why in report:
            verdicts[name].append("[bold green]chosen[/]" if name == chosen else "supported" if ok else f"[dim]{why}[/]")
    for name, cells in verdicts.items():
        table.add_row(name, *cells)
    console.print(table)
    return 0


def _backends_table(backends) -> Table:
    table = Table(title="experts backends (fastest first)", title_justify="left")
    for name in ("backend", "available", "dtypes", "layout"):
        table.add_column(name, no_wrap=name != "layout")
    for p in backends:
        why = getattr(p, "unavailable", "")
        table.add_row(p.name, f"no: {why}" if why else "yes", "/".join(getattr(p, "dtypes", ["any"])),
                      getattr(p, "layout", "per-expert torch GEMMs"))
    return table


def _choice_table(report: list[tuple[str, bool, str]], chosen: str) -> Table:
    table = Table(title="oracle, fastest first", title_justify="left")
    table.add_column("backend", no_wrap=True)
    table.add_column("verdict")
    for name, ok, why in report:
        if name == chosen:
            verdict = "[bold green]chosen[/]"
        elif ok:
            verdict = f"supported, ranked after {chosen}"
        else:
            verdict = f"not supported: {why}"
        table.add_row(name, verdict)
    return table


# ---- cpumoe bench ... -------------------------------------------------------------------------------------------

def _add_bench(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True,
                                                                           metavar="BENCH")
    p = bench.add_parser("layer", help="time one MoE layer on every experts backend this CPU can run")
    p.add_argument("--preset", type=_preset, default=DEFAULT_PRESET, help=f"layer preset (default {DEFAULT_PRESET})")
    p.add_argument("--hidden", type=int, help="override H (with none of the preset's shape: a custom layer)")
    p.add_argument("--inter", type=int, help="override I")
    p.add_argument("--experts", type=int, help="override E")
    p.add_argument("--topk", type=int, help="override k")
    p.add_argument("--tokens", type=positive_ints, default=[1, 8, 32, 128, 512, 2048],
                   help="token counts M, comma-separated (default 1,8,32,128,512,2048)")
    p.add_argument("--dtype", type=weight_formats, default=["bf16"],
                   help="weight formats, comma-separated: bf16 (default), fp32, fp16, and quantized int8, int4, "
                        "fp8, mxfp4 (or int8_w8a8, int4_w4a16, fp8_w8a16, mxfp4_w4a16; on bf16 activations)")
    p.add_argument("--group-size", type=int, default=128, help="int4 group / fp8 k block along K (default 128)")
    p.add_argument("--backends", type=names,
                   help="only these experts backends, comma-separated (default: all available)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--json", metavar="FILE", help="also write every result and the machine's limits here")
    p.add_argument("--quick", action="store_true", help="1-3 repetitions per case and a quicker machine measurement")
    add_db_arguments(p)
    p.set_defaults(func=_cmd_bench_layer)

    p = bench.add_parser("model", help="the offline engine on random prompts: TTFT, ITL, throughput, decode GB/s")
    p.add_argument("model", nargs="+",
                   help="a local Hugging Face checkpoint directory (e.g. from cpumoe make-model); several (e.g. one "
                        "and its `cpumoe quantize` twins) are measured side by side against the first")
    p.add_argument("--batch", type=positive_ints, default=[1, 16], help="batch sizes (default 1,16)")
    p.add_argument("--input-len", type=positive_ints, default=[128, 512], help="prompt lengths (default 128,512)")
    p.add_argument("--output-len", type=positive_ints, default=[128], help="output lengths (default 128)")
    p.add_argument("--dtype", type=_dtype, default=None, help="bf16, fp32 or fp16 (default: the checkpoint's)")
    p.add_argument("--compare", choices=["naive"], help="also run the experts on this backend, case by case")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--json", metavar="FILE", help="also write every result here")
    p.add_argument("--repeats", type=int, default=3, help="round-robin repetitions of every case (default 3)")
    p.add_argument("--prefill-prompts", type=positive_int,
                   help="with several checkpoints: prompts per case and repetition that each prefills in turn, for "
                        "the prefill ratios (default: bench.model.PREFILL_PROMPTS, 4)")
    p.add_argument("--quick", action="store_true", help="one repetition, a smaller bandwidth probe and mm (smoke runs)")
    p.add_argument("--speculative-config", type=_speculative, action="append", metavar="JSON",
                   help="instead: speculative decoding against none, same run; repeatable. " + SPECULATIVE_HELP)
    p.add_argument("--speculative-k", type=positive_ints, metavar="K,K",
                   help="with --speculative-config: each config at each of these num_speculative_tokens")
    p.add_argument("--prompt", type=names, default=["random"],
                   help="with --speculative-config: prompt kinds, comma-separated: random (default), repeated (a "
                        "32-token phrase over and over)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="also run each checkpoint batch-invariant (" + BATCH_INVARIANT_HELP + "), side by side: the "
                        "mode's cost, same run")
    p.add_argument("--profile", action="store_true",
                   help="instead: where a decode step's time goes (experts, dense GEMMs, attention, glue, engine) at "
                        "each --batch, after a prompt of the first --input-len")
    add_db_arguments(p)
    p.set_defaults(func=_cmd_bench_model)

    from cpumoe.bench.activation.cli import add_parser as add_experts
    from cpumoe.bench.pruning.cli import add_parser as add_prune_sweep
    from cpumoe.bench.serve.cli import add_parser as add_serve
    from cpumoe.bench.sweep.cli import add_parser as add_sweep
    from cpumoe.bench.threads.cli import add_parser as add_threads
    from cpumoe.bench.throughput.cli import add_parser as add_throughput
    for add in (add_serve, add_throughput, add_sweep, add_experts, add_prune_sweep, add_threads):
        add(bench)


def _layer_preset(args):
    """The preset, with any of --hidden/--inter/--experts/--topk replacing its shape."""
    overrides = {field: value for field, value in
                 (("hidden", args.hidden), ("inter", args.inter), ("experts", args.experts), ("top_k", args.topk))
                 if value is not None}
    if not overrides:
        return args.preset
    if min(overrides.values()) < 1:
        sys.exit("cpumoe bench layer: error: --hidden/--inter/--experts/--topk must be positive")
    preset = dataclasses.replace(args.preset, name="custom", **overrides)
    if preset.top_k > preset.experts:
        sys.exit(f"cpumoe bench layer: error: top-k {preset.top_k} exceeds {preset.experts} experts")
    if preset.router_weight_on_input and preset.top_k != 1:
        preset = dataclasses.replace(preset, router_weight_on_input=False)
    return preset


def _cmd_bench_layer(args) -> int:
    from cpumoe.bench.layer import parse_weight_format, render_layer_report, run_layer_bench, select_cases

    if args.threads is not None:
        if args.threads < 1:
            sys.exit("cpumoe bench layer: error: --threads must be positive")
        torch.set_num_threads(args.threads)
    preset = _layer_preset(args)
    console = stdout_console()
    try:
        formats = [parse_weight_format(name, args.group_size) for name in args.dtype]
        select_cases(preset, formats, args.backends)   # fail now, not after measuring the machine
    except ValueError as e:   # an unknown --backends entry, a group size the shape cannot take, nothing to run
        sys.exit(f"cpumoe bench layer: error: {e}")
    report = run_layer_bench(preset, formats, args.tokens, backends=args.backends, quick=args.quick,
                             progress=Console(stderr=True))
    render_layer_report(report, console)
    _write_json(report, args.json, console)
    from cpumoe.bench.sweep.rows import record_layer_report
    _record(args.db, args.no_db, lambda db: record_layer_report(db, report), console)
    return 0


def _record(path: str, skip: bool, write, console: Console) -> None:
    """write(db) appends a report's rows to the results database at `path` (unless `skip`: --no-db)."""
    from cpumoe.bench.results import ResultsDB
    if skip:
        return
    try:
        with ResultsDB(path) as db:
            ids = write(db)
    except ValueError as e:
        sys.exit(f"cpumoe bench: error: --db: {e}")
    console.print(f"{len(ids)} rows appended to {path}")


def _write_json(report: dict, path: str | None, console: Console) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"results written to {path}")


def _cmd_bench_model(args) -> int:
    import itertools

    from cpumoe.bench.model import (PREFILL_PROMPTS, ModelCase, render_formats_report, render_model_report,
                                    run_formats_bench, run_model_bench)

    if args.threads is not None:
        if args.threads < 1:
            sys.exit("cpumoe bench model: error: --threads must be positive")
        torch.set_num_threads(args.threads)
    cases = [ModelCase(b, i, o) for b, i, o in itertools.product(args.batch, args.input_len, args.output_len)]
    console = stdout_console()
    if args.profile:
        return _profile_model(args, console)
    if args.speculative_config:
        return _speculative_model(args, cases, console)
    try:
        if args.repeats < 1:
            raise ValueError("--repeats must be positive")
        if args.batch_invariant and args.compare:
            raise ValueError("--compare naive and --batch-invariant do not go together (naive runs torch's GEMMs)")
        if len(args.model) > 1 or args.batch_invariant:
            if args.compare:
                raise ValueError("--compare naive takes one checkpoint")
            paths = [p for p in args.model for _ in range(2 if args.batch_invariant else 1)]
            report = run_formats_bench(paths, cases, dtype=args.dtype, quick=args.quick, repeats=args.repeats,
                                       progress=Console(stderr=True),
                                       prefill_prompts=args.prefill_prompts or PREFILL_PROMPTS,
                                       batch_invariant=[args.batch_invariant and i % 2 == 1 for i in range(len(paths))])
        else:
            report = run_model_bench(args.model[0], cases, dtype=args.dtype, compare_naive=args.compare == "naive",
                                     quick=args.quick, repeats=args.repeats, progress=Console(stderr=True))
    except ValueError as e:  # a checkpoint that is missing, incomplete or not supported
        sys.exit(f"cpumoe bench model: error: {e}")
    (render_formats_report if "models" in report else render_model_report)(report, console)
    _write_json(report, args.json, console)
    from cpumoe.bench.sweep.rows import record_model_report
    _record(args.db, args.no_db, lambda db: record_model_report(db, report), console)
    return 0


def _speculative_model(args, cases, console) -> int:
    from cpumoe.bench.speculative import PROMPT_KINDS, render_speculative_report, run_speculative_bench, with_k

    try:
        if len(args.model) > 1:
            raise ValueError("--speculative-config takes one checkpoint")
        unknown = sorted(set(args.prompt) - set(PROMPT_KINDS))
        if unknown:
            raise ValueError(f"unknown --prompt {', '.join(unknown)} (known: {', '.join(PROMPT_KINDS)})")
        if args.repeats < 1:
            raise ValueError("--repeats must be positive")
        report = run_speculative_bench(args.model[0], cases, with_k(args.speculative_config, args.speculative_k),
                                       prompt_kinds=args.prompt, dtype=args.dtype,
                                       repeats=1 if args.quick else args.repeats, progress=Console(stderr=True))
    except ValueError as e:
        sys.exit(f"cpumoe bench model: error: {e}")
    render_speculative_report(report, console)
    _write_json(report, args.json, console)
    return 0


def _profile_model(args, console) -> int:
    from cpumoe.bench.profile import render_profile, run_profile

    if len(args.model) > 1:
        sys.exit("cpumoe bench model: error: --profile takes one checkpoint")
    try:
        report = run_profile(args.model[0], args.batch, args.input_len[0], dtype=args.dtype)
    except ValueError as e:
        sys.exit(f"cpumoe bench model: error: {e}")
    render_profile(report, console)
    _write_json(report, args.json, console)
    return 0


# ---- cpumoe make-model ------------------------------------------------------------------------------------------

def _add_make_model(commands) -> None:
    p = commands.add_parser("make-model", help="write a synthetic Hugging Face checkpoint with a real model's shapes")
    p.add_argument("--preset", default=DEFAULT_PRESET,
                   help=f"model (default {DEFAULT_PRESET}); any preset of cpumoe.models: see cpumoe info --presets")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: the real model's)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--dtype", type=_dtype, default=torch.bfloat16, help="bf16 (default), fp32 or fp16")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)   # tests: tiny hidden/experts sizes
    p.set_defaults(func=_cmd_make_model)


def _cmd_make_model(args) -> int:
    from pathlib import Path

    from rich.progress import Progress

    from cpumoe.synthetic import make_checkpoint, tiny_overrides

    console = stdout_console()
    try:
        overrides = tiny_overrides(args.preset) if args.tiny else None
        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("writing shards", total=None)
            out = make_checkpoint(args.preset, args.out, layers=args.layers, vocab=args.vocab, seed=args.seed,
                                  dtype=args.dtype, overrides=overrides,
                                  progress=lambda done, total, _: bar.update(task, completed=done, total=total))
    except ValueError as e:
        sys.exit(f"cpumoe make-model: error: {e}")
    files = sorted(p for p in Path(out).iterdir() if p.is_file())
    table = Table(title=f"{args.preset}, {args.layers} layers -> {out}", title_justify="left")
    table.add_column("file", no_wrap=True)
    table.add_column("size", justify="right")
    for f in files:
        table.add_row(f.name, _size(f.stat().st_size))
    console.print(table)
    from safetensors import safe_open
    params = 0
    for f in files:
        if f.suffix == ".safetensors":
            with safe_open(f, "pt") as st:
                params += sum(_numel(st.get_slice(k).get_shape()) for k in st.keys())
    console.print(f"total {_size(sum(f.stat().st_size for f in files))}, {params:,} parameters ({params / 1e9:.2f} B)")
    return 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _size(nbytes: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000


# ---- cpumoe quantize --------------------------------------------------------------------------------------------

def _add_quantize(commands) -> None:
    p = commands.add_parser("quantize", help="write a float checkpoint in a public quantized layout")
    p.add_argument("src", metavar="SRC", help="a float (bf16) checkpoint directory")
    p.add_argument("dst", metavar="DST", help="output directory (new or empty)")
    p.add_argument("--format", required=True, help="int8_w8a8, int4_w4a16, fp8_w8a16 or mxfp4 (or int8, int4, fp8)")
    p.add_argument("--layout", choices=["compressed-tensors", "gptq", "awq", "fp8", "mxfp4"],
                   help="on-disk layout (default: compressed-tensors; fp8: block FP8; mxfp4: gpt-oss's own for "
                        "gpt-oss, compressed-tensors otherwise)")
    p.add_argument("--group-size", type=int, help="int4 group / fp8 block along K (default 128)")
    p.add_argument("--asymmetric", action="store_true", help="int4 with zero points (AWQ always has them)")
    p.add_argument("--lm-head", action="store_true",
                   help="quantize the lm_head too (as GPTQ's lm_head=true checkpoints; default: kept in float, as "
                        "most public quantized checkpoints keep it)")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="shard size in GB at most (default 2)")
    p.set_defaults(func=_cmd_quantize)


def _cmd_quantize(args) -> int:
    from rich.progress import Progress

    from cpumoe.loader.quantized.convert import quantize_checkpoint

    console = stdout_console()
    try:
        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("quantizing", total=None)
            result = quantize_checkpoint(args.src, args.dst, args.format, layout=args.layout,
                                         group_size=args.group_size, symmetric=False if args.asymmetric else None,
                                         lm_head=args.lm_head,
                                         max_shard_bytes=max(1, int(args.max_shard_gb * 1024**3)),
                                         progress=lambda done, total: bar.update(task, completed=done, total=total))
    except ValueError as e:   # an unknown format or layout, a checkpoint that is missing, quantized or unfit
        sys.exit(f"cpumoe quantize: error: {e}")
    size = sum((result.path / f).stat().st_size for f in result.files)
    console.print(f"{len(result.quantized)} linears quantized ({result.layout}), {len(result.unquantized)} kept in "
                  f"float; {len(result.files)} shard(s), {_size(size)} -> {result.path}")
    return 0


# ---- cpumoe serve -----------------------------------------------------------------------------------------------

def _add_serve(commands) -> None:
    p = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", metavar="MODEL", help="a Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("CPUMOE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 (default: $CPUMOE_API_KEY; none: open)")
    p.add_argument("--dtype", type=_dtype, default=torch.bfloat16, help="bf16 (default), fp32 or fp16")
    p.add_argument("--max-model-len", type=int, help="context length: prompt + generated tokens (default: the "
                                                    "model's)")
    p.add_argument("--allow-long-max-model-len", action="store_true",
                   help="let --max-model-len exceed the model's max_position_embeddings (positions it was not "
                        "trained on)")
    p.add_argument("--served-model-name", help="the name clients send as `model` (default: the engine's)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: /v1/completions takes token-id prompts and answers with token_ids (a "
                        "checkpoint without a tokenizer is refused unless this is given)")
    defaults = EngineConfig()
    p.add_argument("--kv-cache-gb", type=float, default=round(defaults.kv_cache_bytes / 1e9, 2),
                   help=f"KV cache size in GB, all layers (default {defaults.kv_cache_bytes / 1e9:.2f})")
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                   help=f"requests running at once, at most (default {defaults.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                   help=f"tokens one engine step runs (decodes + prefill chunks; default "
                        f"{defaults.max_num_batched_tokens})")
    p.add_argument("--speculative-config", type=_speculative, metavar="JSON", help=SPECULATIVE_HELP)
    p.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP + " (default: off)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=defaults.enable_prefix_caching,
                   help="share the KV cache of prompt prefixes computed before (default: on)")
    p.add_argument("--max-connections", type=int, default=limits.MAX_CONNECTIONS,
                   help=f"connections served at once; beyond them a 503 (default {limits.MAX_CONNECTIONS}; slow "
                        f"headers time out after {limits.HEADER_TIMEOUT_S:g} s, idle kept-alive connections after "
                        f"{limits.IDLE_TIMEOUT_S:g} s)")
    p.add_argument("--max-request-mb", type=float, default=limits.MAX_REQUEST_BYTES / (1 << 20),
                   help="larger request bodies are refused with 413 before they are read (default "
                        f"{limits.MAX_REQUEST_BYTES / (1 << 20):g})")
    p.add_argument("--shutdown-grace-s", type=float, default=limits.SHUTDOWN_GRACE_S,
                   help="on SIGTERM or Ctrl-C, how long requests in flight may still run before they end with an "
                        f"error (default {limits.SHUTDOWN_GRACE_S:g})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args) -> int:
    if not 0 < args.port < 65536:
        sys.exit(f"cpumoe serve: error: --port must be in 1..65535, got {args.port}")
    if args.max_model_len is not None and args.max_model_len < 2:
        sys.exit(f"cpumoe serve: error: --max-model-len must be at least 2, got {args.max_model_len}")
    if args.max_connections < 1:
        sys.exit(f"cpumoe serve: error: --max-connections must be positive, got {args.max_connections}")
    if not 0 <= args.shutdown_grace_s < 1e6:
        sys.exit(f"cpumoe serve: error: --shutdown-grace-s must be a number of seconds >= 0, got {args.shutdown_grace_s}")
    if not 0 < args.max_request_mb < 1e6:
        sys.exit(f"cpumoe serve: error: --max-request-mb must be positive, got {args.max_request_mb}")
    _check_kv_cache_gb("serve", args.kv_cache_gb)
    from cpumoe.engine.engine import has_tokenizer
    if not args.skip_tokenizer_init and Path(args.model).is_dir() and not has_tokenizer(args.model):
        sys.exit(f"cpumoe serve: error: {args.model} has no tokenizer (tokenizer.json, tokenizer_config.json): every "
                 "text request would fail; add one, or pass --skip-tokenizer-init to serve token-id prompts")
    from cpumoe.engine.async_engine import AsyncEngine
    from cpumoe.server.run import bind, serve

    try:   # the port first: one in use fails now, not after the model has loaded
        sock = bind(args.host, args.port)
    except OSError as e:
        sys.exit(f"cpumoe serve: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    try:
        config = EngineConfig(max_model_len=args.max_model_len, kv_cache_bytes=max(1, int(args.kv_cache_gb * 1e9)),
                              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              allow_long_max_model_len=args.allow_long_max_model_len,
                              speculative=args.speculative_config, batch_invariant=args.batch_invariant,
                              enable_prefix_caching=args.enable_prefix_caching)
        engine = AsyncEngine.from_path(args.model, dtype=args.dtype, config=config, model_name=args.served_model_name,
                                       skip_tokenizer=args.skip_tokenizer_init)
    except (OSError, ValueError) as e:   # no such checkpoint, a config the engine rejects
        sys.exit(f"cpumoe serve: error: {e}")
    serve(engine, args.host, args.port, api_key=args.api_key, log_level=args.log_level, sock=sock,
          max_request_bytes=int(args.max_request_mb * (1 << 20)), max_connections=args.max_connections,
          shutdown_grace_s=args.shutdown_grace_s)
    return 0


def _check_kv_cache_gb(command: str, gb: float) -> None:
    """A KV cache size that is not a positive finite number, or more than this machine's memory, stops here."""
    import math
    if not (math.isfinite(gb) and gb > 0):
        sys.exit(f"cpumoe {command}: error: --kv-cache-gb must be a positive number, got {gb}")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if gb * 1e9 > total:
        sys.exit(f"cpumoe {command}: error: --kv-cache-gb {gb} is more than this machine's memory "
                 f"({total / 1e9:.1f} GB)")


# ---- cpumoe generate --------------------------------------------------------------------------------------------

def _add_generate(commands) -> None:
    p = commands.add_parser("generate", help="stream a completion from a local checkpoint, then tokens/s")
    p.add_argument("model", help="checkpoint directory (config.json, safetensors, tokenizer)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: off)")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--dtype", type=_dtype, help="weights and KV cache dtype (default: the checkpoint's)")
    p.add_argument("--backend", default="auto", help="experts backend (default: the oracle's choice)")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache size in GB (default 1)")
    p.add_argument("--speculative-config", type=_speculative, metavar="JSON", help=SPECULATIVE_HELP)
    p.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args) -> int:
    import time

    from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams

    _check_kv_cache_gb("generate", args.kv_cache_gb)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        config = EngineConfig(kv_cache_bytes=max(1, int(args.kv_cache_gb * 1e9)), speculative=args.speculative_config,
                              batch_invariant=args.batch_invariant)
        engine = LLMEngine(args.model, dtype=args.dtype, backend=args.backend, config=config)
        prompt_ids = engine.encode(args.prompt, chat=args.chat)
        engine.add_request("cli", prompt_ids, params)
    except ValueError as e:   # bad sampling values, checkpoint errors, a prompt that does not fit
        sys.exit(f"cpumoe generate: error: {e}")
    start = time.perf_counter()
    first = out = None
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.new_token_ids:
                first = time.perf_counter()
            print(out.new_text, end="", flush=True)
    end = time.perf_counter()
    print()
    n = out.completion_tokens if out else 0
    decode = f", decode {(n - 1) / (end - first):.1f} tokens/s" if first is not None and n > 1 and end > first else ""
    print(f"[{n} tokens in {end - start:.2f} s: {n / (end - start):.1f} tokens/s; prompt {len(prompt_ids)} tokens, "
          f"first token {(first or end) - start:.3f} s{decode}; finish {out.finish_reason if out else '-'}]")
    stats = engine.stats()
    if "draft_tokens" in stats:
        rate = stats["accepted_tokens"] / stats["draft_tokens"] if stats["draft_tokens"] else 0.0
        print(f"[speculative: {stats['accepted_tokens']} of {stats['draft_tokens']} drafts accepted ({rate:.0%}) "
              f"in {stats['verify_steps']} verifying steps]")
    return 0
