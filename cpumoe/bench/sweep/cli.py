"""The parser of `cpumoe bench sweep layer|arch-model|model` (argparse only: the handler imports what it runs).

    sweep layer       the fused MoE layer over the architecture axes (one at a time around --skeleton), x --dtype
                      x --experts fused,naive x --tokens          -> `layer` rows
    sweep arch-model  a synthetic checkpoint of --layers N per shape, the offline engine on it
                      x --batch x --input-len x --output-len      -> `model` rows
    sweep model       checkpoints (e.g. one and its `cpumoe quantize` twins) x --batch x --input-len x --output-len
                      x --experts                                 -> `model` rows
"""
from __future__ import annotations

import argparse
import os
import sys

from cpumoe.bench.results import add_db_arguments
from cpumoe.cli_args import names, positive_ints, unique_names

PROG = "cpumoe bench sweep"


def _grid(name: str):
    from cpumoe.bench.sweep.grid import get_grid
    try:
        return get_grid(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _impls(text: str) -> list[str]:
    from cpumoe.bench.sweep.plan import IMPLS
    chosen = unique_names(text)
    unknown = [n for n in chosen if n not in IMPLS]
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(IMPLS)}, got {text!r}")
    return chosen


def _float_dtypes(text: str) -> list[str]:
    from cpumoe.bench.layer import FLOAT_DTYPES
    chosen = unique_names(text)
    unknown = [n for n in chosen if n not in FLOAT_DTYPES]
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(f"unknown dtype {', '.join(unknown) or text!r}; choose from bf16, fp32, fp16")
    return chosen


def _float_dtype(text: str) -> str:
    names = _float_dtypes(text)
    if len(names) != 1:
        raise argparse.ArgumentTypeError(f"expected one dtype, got {text!r}")
    return names[0]


def _shape(text: str) -> tuple[int, int, int, int]:
    values = positive_ints(text)
    if len(values) != 4 or values[3] > values[2]:
        raise argparse.ArgumentTypeError(f"expected H,I,E,K with K <= E, got {text!r}")
    return tuple(values)


def _skeleton(args):
    """The --skeleton preset, with --skeleton-shape's sizes."""
    import dataclasses

    from cpumoe.presets import get_preset
    try:
        preset = get_preset(args.skeleton)
    except ValueError as e:
        _fail(args, str(e))
    if args.skeleton_shape is None:
        return preset
    hidden, inter, experts, top_k = args.skeleton_shape
    return dataclasses.replace(preset, hidden=hidden, inter=inter, experts=experts, top_k=top_k,
                               router_weight_on_input=preset.router_weight_on_input and top_k == 1)


def add_parser(subparsers) -> None:
    from cpumoe.cli_args import weight_formats

    sweep = subparsers.add_parser("sweep", help="the MoE-Inference-Bench sweeps (resumable, memory-checked, on Ray)")
    kinds = sweep.add_subparsers(dest="sweep", required=True, metavar="SWEEP")

    def common(p, *, impl_help: str) -> None:
        p.add_argument("--grid", type=_grid, default="paper",
                       help="named axis values: paper (default: the paper's grids), small (its end points); any "
                            "axis flag below replaces that axis")
        p.add_argument("--experts", type=_impls, default=["fused"], metavar="IMPLS", help=impl_help)
        p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                       help="threads per case, and CPUs a Ray task reserves (default: all cores, %(default)s here)")
        add_db_arguments(p)
        p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                       help="run each unit as a Ray task (no ADDRESS: a local Ray runtime; else connect to it)")
        p.add_argument("--max-memory-gb", type=float,
                       help="a case may use at most this much memory (default: MemAvailable less a margin)")
        p.add_argument("--full", action="store_true",
                       help="the benches' full timing (default: their quick mode, which the paper grid needs to "
                            "finish in the hour)")
        p.add_argument("--dry-run", action="store_true", help="print the cases and the time estimate, run nothing")

    def shape_axes(p) -> None:
        p.add_argument("--skeleton", default="mixtral-8x7b",
                       help="the preset every axis varies around: its routing, activation and sizes (default "
                            "%(default)s)")
        p.add_argument("--skeleton-shape", type=_shape, metavar="H,I,E,K",
                       help="replace the skeleton's sizes (e.g. 64,32,4,2 for a tiny one)")
        p.add_argument("--inter", type=positive_ints, help="FFN dimensions I (paper: 1792,3584,7168,14336)")
        p.add_argument("--num-experts", type=positive_ints, help="experts E (paper: 8,16,32,64)")
        p.add_argument("--top-k", type=positive_ints, help="experts per token k (paper: 1,2,4,8)")
        p.add_argument("--hidden", type=positive_ints, help="hidden sizes H (paper grid: 1024,2048,4096,8192)")

    def runtime_axes(p, batch: str, input_len: str, output_len: str) -> None:
        p.add_argument("--batch", type=positive_ints, help=f"batch sizes (default {batch}; paper: 1,16,32,64)")
        p.add_argument("--input-len", type=positive_ints,
                       help=f"prompt lengths (default {input_len}; paper: 128,256,512,1024,2048)")
        p.add_argument("--output-len", type=positive_ints,
                       help=f"output lengths (default {output_len}; paper: 128,256,512,1024,2048)")

    p = kinds.add_parser("layer", help="the fused MoE layer over the architecture axes")
    common(p, impl_help="experts impls, comma-separated: fused (the oracle's backend; default), naive")
    shape_axes(p)
    p.add_argument("--tokens", type=positive_ints, help="token counts M (paper: 1,16,32,64)")
    p.add_argument("--dtype", type=weight_formats, default=["bf16"],
                   help="weight formats as `bench layer` takes them: bf16 (default), fp32, fp16, int8, int4, fp8, "
                        "mxfp4")
    p.add_argument("--group-size", type=int, default=128, help="int4 group / fp8 k block (default 128)")
    p.set_defaults(func=_cmd_layer)

    p = kinds.add_parser("arch-model", help="the architecture axes on synthetic checkpoints through the engine")
    common(p, impl_help="experts impls, comma-separated: fused (default), naive")
    shape_axes(p)
    runtime_axes(p, "1,16", "128", "128")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of each synthetic checkpoint (default 2)")
    p.add_argument("--vocab", type=int, default=1024, help="its vocabulary (default 1024)")
    p.add_argument("--dtype", type=_float_dtypes, default=["bf16"], help="bf16 (default), fp32, fp16; a list")
    p.add_argument("--tmp-dir", help="where the checkpoints are written (default: the system's temporary directory)")
    p.add_argument("--repeats", type=int, default=None, help="runs per case, median kept (default 1; 3 with --full)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)   # tests: tiny attention and heads
    p.set_defaults(func=_cmd_arch_model)

    p = kinds.add_parser("model", help="checkpoints through the engine over batch x input x output")
    common(p, impl_help="experts impls, comma-separated: fused (default), naive")
    p.add_argument("model", nargs="+", help="checkpoint directories (e.g. one and its `cpumoe quantize` twins)")
    runtime_axes(p, "the grid's", "the grid's", "the grid's")
    p.add_argument("--names", type=names, help="short model names for the rows (default: the directory names)")
    p.add_argument("--dtype", type=_float_dtype, help="bf16, fp32 or fp16 (default: each checkpoint's)")
    p.add_argument("--repeats", type=int, default=None, help="runs per case, median kept (default 1; 3 with --full)")
    p.set_defaults(func=_cmd_model)


def _fail(args, message: str) -> None:
    sys.exit(f"{PROG} {args.sweep}: error: {message}")


def _check_common(args) -> None:
    if args.threads < 1:
        _fail(args, f"--threads must be positive, got {args.threads}")
    if args.max_memory_gb is not None and not args.max_memory_gb > 0:
        _fail(args, f"--max-memory-gb must be positive, got {args.max_memory_gb}")
    if getattr(args, "repeats", None) is not None and args.repeats < 1:
        _fail(args, f"--repeats must be positive, got {args.repeats}")
    if args.ray is not None:
        from cpumoe.bench.sweep.runner import SweepError, import_ray
        try:
            import_ray()
        except SweepError as e:
            _fail(args, str(e))


def _shapes(args, skeleton):
    from cpumoe.bench.sweep.grid import arch_shapes
    grid = args.grid
    axes = dict(inter=args.inter or grid.inter, experts=args.num_experts or grid.experts,
                top_k=args.top_k or grid.top_k, hidden=args.hidden or grid.hidden)
    try:
        return arch_shapes(skeleton, {k: tuple(v) for k, v in axes.items()})
    except ValueError as e:
        _fail(args, str(e))


def _options(args):
    from cpumoe.bench.sweep.plan import RunOptions
    repeats = getattr(args, "repeats", None) or (3 if args.full else 1)
    return RunOptions(threads=args.threads, quick=not args.full, repeats=repeats)


ARCH_MODEL_RUNS = dict(batch=(1, 16), input_len=(128,), output_len=(128,))   # arch-model's runs unless given


def _runs(args, defaults=None):
    """batch x input x output: the flags', else `defaults`, else the grid's."""
    from cpumoe.bench.sweep.plan import runs_of
    axes = defaults or dict(batch=args.grid.batch, input_len=args.grid.input_len, output_len=args.grid.output_len)
    runs = runs_of(args.batch or axes["batch"], args.input_len or axes["input_len"],
                   args.output_len or axes["output_len"])
    if not runs:
        _fail(args, "no runs: give --batch, --input-len and --output-len")
    return runs


def _cmd_layer(args) -> int:
    from cpumoe.bench.sweep.plan import layer_units

    _check_common(args)
    skeleton = _skeleton(args)
    if args.group_size < 1:
        _fail(args, f"--group-size must be positive, got {args.group_size}")
    tokens = args.tokens or args.grid.tokens
    if not tokens:
        _fail(args, "no token counts: give --tokens")
    units = layer_units(skeleton, _shapes(args, skeleton), args.dtype, args.experts, tokens, _options(args),
                        group_size=args.group_size)
    return _run(args, units)


def _cmd_arch_model(args) -> int:
    from cpumoe.bench.sweep.plan import arch_model_units
    from cpumoe.synthetic.checkpoint import layer_shape_overrides, preset_config, preset_names, tiny_overrides
    from cpumoe.synthetic.tokenizer import MIN_VOCAB

    _check_common(args)
    if args.skeleton not in preset_names():
        _fail(args, f"no synthetic checkpoint for skeleton {args.skeleton!r}; known: {', '.join(preset_names())}")
    if args.layers < 1:
        _fail(args, f"--layers must be positive, got {args.layers}")
    if args.vocab < MIN_VOCAB:
        _fail(args, f"--vocab must be at least {MIN_VOCAB} (the tokenizer's bytes and specials), got {args.vocab}")
    if args.tmp_dir and not os.path.isdir(args.tmp_dir):
        _fail(args, f"--tmp-dir {args.tmp_dir} is not a directory")
    overrides = None
    if args.tiny:   # the skeleton's tiny attention; the swept MoE sizes stay as given
        keep = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
                "num_experts_per_tok")
        overrides = {k: v for k, v in tiny_overrides(args.skeleton).items() if k not in keep}
    skeleton = _skeleton(args)
    shapes = _shapes(args, skeleton)
    heads = (overrides or preset_config(args.skeleton))["num_attention_heads"]
    odd = [s.hidden for s in shapes if s.hidden % heads]
    if odd:
        _fail(args, f"hidden size {odd[0]} is not a multiple of the {heads} attention heads of {args.skeleton}")
    for shape in shapes:  # a shape the architecture's config cannot say (Phi-3.5-MoE routes to exactly 2 experts)
        try:
            layer_shape_overrides(args.skeleton, hidden=shape.hidden, inter=shape.inter, experts=shape.experts,
                                  top_k=shape.top_k)
        except ValueError as e:
            _fail(args, str(e))
    units = arch_model_units(args.skeleton, shapes, args.dtype, args.experts, _runs(args, ARCH_MODEL_RUNS),
                             _options(args),
                             layers=args.layers, vocab=args.vocab, tmp_dir=args.tmp_dir, overrides=overrides)
    return _run(args, units)


def _cmd_model(args) -> int:
    from cpumoe.bench.sweep.plan import model_units

    _check_common(args)
    try:
        units = model_units(args.model, args.names, args.dtype, args.experts, _runs(args), _options(args))
    except ValueError as e:   # a missing or unreadable checkpoint (CheckpointError), names that do not match
        _fail(args, str(e))
    return _run(args, units)


def _run(args, units) -> int:
    from cpumoe.bench.results import ResultsDB
    from cpumoe.bench.sweep.memory import MemoryPolicy
    from cpumoe.bench.sweep.report import print_plan, print_summary
    from cpumoe.bench.sweep.runner import SweepError, cluster_machines, connect_ray, pending_units, run_sweep
    from cpumoe.cli_args import stdout_console
    from rich.console import Console

    console = stdout_console()
    try:
        db = None if args.no_db else ResultsDB(args.db)
    except ValueError as e:   # a file that is not a results database
        _fail(args, str(e))
    policy = MemoryPolicy(limit_bytes=None if args.max_memory_gb is None else int(args.max_memory_gb * 1e9))
    try:
        machines = None
        if args.ray is not None:   # a case done on any of the cluster's machines is done
            connect_ray(args.ray or None)
            machines = cluster_machines()
        todo, skipped, total = pending_units(units, db, machines)
        print_plan(console, args, todo, skipped, total, db)
        if args.dry_run:
            return 0
        summary = run_sweep(units, db=db, policy=policy, ray=args.ray is not None, machines=machines,
                            console=Console(stderr=True))
    except SweepError as e:
        _fail(args, str(e))
    except KeyboardInterrupt:
        done = "" if db is None else f"; the rows written so far are in {db.path}: run the same command to resume"
        console.print(f"[yellow]interrupted{done}[/]")
        return 130
    finally:
        if db is not None:
            db.close()
    print_summary(console, summary, db_path=None if args.no_db else args.db)
    return 0
