"""`cpumoe bench prune`: the pruning sweep. Speed and quality of inter- and intra-expert pruned copies of a
checkpoint, against the unpruned model on the same tokens.

    full model (cpumoe's loader) -> calibration routing counts (inter), reference logits on the evaluation tokens
    unpruned baseline: quality (perplexity) + speed          -> one `prune` row, method "none", ratio 0
    per (method, ratio): prune_checkpoint -> a temporary directory
        quality: its logits on the same tokens -> perplexity, top-1 agreement, KL(p_full || p_pruned)
        speed:   cpumoe.bench.model.run_case on one case (a warm-up, then the median of `repeats` runs): decode
                 and prefill tokens/s
        -> one `prune` row (status "error" with the message where the case cannot be pruned, e.g. top-k > experts)

Quality is measured on a text file's tokens (--text, one prompt per non-empty line), or on random tokens: then
the perplexity is that of noise and only its change against the unpruned model means something. The reference
logits [N, V] of every evaluation position are held in float32 (256 positions of a 152k vocabulary: 156 MB).
Calibration (which experts inter-pruning drops) uses a separate token set: calibrating on the evaluation text
would flatter inter-pruning.
"""
from __future__ import annotations

import gc
import math
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from cpumoe.bench.activation.run import trace_routing
from cpumoe.bench.activation.tokens import TokenSet, token_set
from cpumoe.prune.quality import kl_divergence, perplexity, top1_agreement


@dataclass(slots=True)
class SweepConfig:
    methods: list[str] = field(default_factory=lambda: ["inter", "intra"])
    ratios: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5])
    text: str | None = None              # evaluation text; None: random tokens
    eval_tokens: int = 256               # random evaluation tokens (without --text)
    calibration: str | None = None       # calibration text; None: random tokens
    calibration_tokens: int = 2048
    max_len: int = 256                   # tokens per routed / evaluated sequence
    batch: int = 1                       # the speed case
    input_len: int = 128
    output_len: int = 32
    repeats: int = 3                     # measured runs of the speed case (median)
    quick: bool = False                  # a 256 MiB bandwidth probe and a 1024^3 mm for the limits
    work_dir: str | None = None          # where the pruned copies are written, one at a time (default: the system's)


@torch.inference_mode()
def eval_logits(model: torch.nn.Module, tokens: TokenSet) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (logits [N, V] float32 of every position that has a next token, targets [N])."""
    logits, targets = [], []
    for seq in tokens.sequences:
        if len(seq) < 2:
            continue
        ids = torch.tensor(seq)  # [T]
        logits.append(model(ids)[:-1].float())  # [T-1, V]
        targets.append(ids[1:])
    if not logits:
        raise ValueError("the evaluation tokens have no sequence of 2 or more tokens")
    return torch.cat(logits), torch.cat(targets)


def measure_speed(path: str | Path, config: SweepConfig) -> dict:
    """Decode and prefill tokens/s of one case (config.batch x input_len, output_len) on the offline engine."""
    from cpumoe.bench.model import (MM_SIZE, QUICK_MM_SIZE, MachineLimits, ModelCase, engine_config, run_case,
                                    weight_bytes)
    from cpumoe.engine import LLMEngine

    case = ModelCase(config.batch, config.input_len, config.output_len)
    engine = LLMEngine(path, config=engine_config([case]))
    weights = weight_bytes(engine)
    limits = MachineLimits(probe_bytes=(256 << 20) if config.quick else (1 << 30),
                           mm_size=QUICK_MM_SIZE if config.quick else MM_SIZE, dtype=engine.dtype)
    run_case(engine, case, limits, weights)  # warm-up
    runs = [run_case(engine, case, limits, weights, seed=1 + i) for i in range(config.repeats)]
    del engine
    gc.collect()
    decode = statistics.median(r.decode_tok_s for r in runs)
    prefill_s = statistics.median(weights.prefill_flops(case.batch, case.input_len) / (r.prefill_gflops * 1e9)
                                  for r in runs)
    mid = sorted(runs, key=lambda r: r.e2e_s)[len(runs) // 2]
    return dict(decode_tok_s=decode, prefill_tok_s=case.batch * case.input_len / prefill_s, ttft_ms=mid.ttft_ms,
                decode_pct_bandwidth=mid.decode_bandwidth_pct, prefill_pct_peak=mid.prefill_mm_pct,
                bandwidth_gbs=mid.bandwidth_gbs, mm_gflops=mid.mm_gflops)


def expert_params(path: str | Path) -> int:
    """Routed expert parameters of a checkpoint (every tensor under '.experts.')."""
    from cpumoe.loader import Checkpoint

    ckpt = Checkpoint(path)
    return sum(math.prod(ckpt.shape(k)) for k in ckpt.keys() if ".experts." in k)


@dataclass(slots=True)
class SweepRow:
    method: str
    ratio: float
    status: str                 # "ok" or "error"
    metrics: dict
    note: str = ""              # what was dropped, or the error


def run_prune_sweep(model_path: str | Path, config: SweepConfig, *,
                    progress: Console | None = None) -> tuple[list[SweepRow], str]:
    """Every case of the sweep, the baseline first; also the evaluation tokens' description."""
    from cpumoe.models import load_model
    from cpumoe.prune.checkpoint import check_prunable, prune_checkpoint

    def say(text: str) -> None:
        if progress is not None:
            progress.print(f"[dim]{text}[/]")

    check_prunable(model_path)
    if config.output_len < 2:
        raise ValueError(f"the speed case needs an output length of 2 or more (decode steps), got {config.output_len}")
    full = load_model(model_path)
    vocab = full.config.vocab_size
    evaluation = token_set(model_path, vocab, text=config.text, random=config.eval_tokens, max_len=config.max_len)
    described = (f"{evaluation.tokens} tokens of {evaluation.name}" if config.text else
                 f"{evaluation.tokens} random tokens (no --text: perplexity of noise, compare against the baseline)")
    counts = None
    if "inter" in config.methods:
        calibration = token_set(model_path, vocab, text=config.calibration, random=config.calibration_tokens,
                                max_len=config.max_len)
        say(f"calibration: routing {calibration.tokens} tokens of {calibration.name}")
        trace = trace_routing(full, calibration)
        counts = {layer: c for layer, c in zip(trace.layers, trace.counts())}
    say(f"reference logits on {described}")
    reference, targets = eval_logits(full, evaluation)
    del full
    gc.collect()
    say("speed of the unpruned model")
    base_speed = measure_speed(model_path, config)
    base = dict(perplexity=perplexity(reference, targets), top1_agreement=1.0, kl_divergence=0.0, **base_speed,
                speedup_decode=1.0, speedup_prefill=1.0, expert_params=expert_params(model_path))
    rows = [SweepRow("none", 0.0, "ok", base)]
    for method in config.methods:
        for ratio in config.ratios:
            with tempfile.TemporaryDirectory(prefix=f"cpumoe-prune-{method}-", dir=config.work_dir) as tmp:
                out = Path(tmp) / "pruned"
                try:
                    result = prune_checkpoint(model_path, out, method=method, ratio=ratio, counts=counts)
                except ValueError as e:
                    rows.append(SweepRow(method, ratio, "error", {"message": str(e)}, str(e)))
                    say(f"{method} {ratio}: {e}")
                    continue
                say(f"{method} {ratio}: quality and speed")
                pruned = load_model(out)
                logits, _ = eval_logits(pruned, evaluation)
                del pruned
                gc.collect()
                speed = measure_speed(out, config)
                metrics = dict(perplexity=perplexity(logits, targets), top1_agreement=top1_agreement(reference, logits),
                               kl_divergence=kl_divergence(reference, logits), **speed,
                               speedup_decode=speed["decode_tok_s"] / base_speed["decode_tok_s"],
                               speedup_prefill=speed["prefill_tok_s"] / base_speed["prefill_tok_s"],
                               expert_params=result.expert_params)
                note = (f"{result.experts[0]} -> {result.experts[1]} experts" if method == "inter" else
                        f"I {result.inter_size[0]} -> {result.inter_size[1]}")
                rows.append(SweepRow(method, ratio, "ok", metrics, note))
    return rows, described


def render_sweep(rows: list[SweepRow], console: Console, *, title: str) -> None:
    table = Table(title=title)
    for column in ("method", "ratio", "pruned", "expert params", "perplexity", "top-1 agree", "KL nats",
                   "decode tok/s", "x", "prefill tok/s", "x"):
        table.add_column(column, justify="right")
    for r in rows:
        m = r.metrics
        if r.status != "ok":
            table.add_row(r.method, f"{r.ratio:g}", f"[red]{r.note}[/]", *[""] * 8)
            continue
        table.add_row(r.method, f"{r.ratio:g}", r.note or "unpruned", f"{m['expert_params']:,}",
                      f"{m['perplexity']:.3f}", f"{100 * m['top1_agreement']:.1f}%", f"{m['kl_divergence']:.3g}",
                      f"{m['decode_tok_s']:.1f}", f"{m['speedup_decode']:.2f}", f"{m['prefill_tok_s']:.0f}",
                      f"{m['speedup_prefill']:.2f}")
    console.print(table)
