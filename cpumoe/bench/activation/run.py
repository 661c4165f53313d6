"""`cpumoe bench experts`: route a token set through a model's prefill and report which experts it chose.

    checkpoint -> load_model -> every sequence of the TokenSet, one prefill each, under a RoutingTrace
      -> counts [L, E] -> imbalance per layer (stats.imbalance) and distinct experts per batch size
      -> heatmap PNG, a rich table, one `experts` row in the results database
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from cpumoe.bench.activation.stats import Imbalance, distinct_by_batch, imbalance
from cpumoe.bench.activation.tokens import TokenSet
from cpumoe.models.routing_trace import RoutingTrace

DEFAULT_BATCHES = [1, 2, 4, 8, 16, 32, 64]


@torch.inference_mode()
def trace_routing(model: torch.nn.Module, tokens: TokenSet) -> RoutingTrace:
    """Every sequence of `tokens` through `model` (one prefill each) under a RoutingTrace."""
    trace = RoutingTrace(model)
    with trace:
        for seq in tokens.sequences:
            model(torch.tensor(seq))  # [T] -> logits [T, V], discarded
    return trace


@dataclass(slots=True)
class ExpertsReport:
    model: str
    source: str                       # the token set's name ("random" or a file name)
    tokens: int
    num_experts: int
    top_k: int
    layers: list[int]                 # decoder layer index of each MoE layer
    counts: list[list[int]]           # [L][E]
    imbalance: Imbalance
    distinct_batches: list[int] = field(default_factory=list)
    distinct_measured: list[float] = field(default_factory=list)
    distinct_uniform: list[float] = field(default_factory=list)

    @property
    def case(self) -> dict:
        return {"model": self.model, "prompts": self.source, "tokens": self.tokens}

    @property
    def metrics(self) -> dict:
        return {"counts": self.counts, "layers": self.layers, "experts": self.num_experts, "top_k": self.top_k,
                "max_over_mean": self.imbalance.max_over_mean, "cv": self.imbalance.cv,
                "entropy": self.imbalance.entropy, "entropy_norm": self.imbalance.entropy_norm,
                "never_chosen": self.imbalance.never_chosen, "distinct_batches": self.distinct_batches,
                "distinct_measured": self.distinct_measured, "distinct_uniform": self.distinct_uniform}


def experts_report(model: torch.nn.Module, tokens: TokenSet, *, name: str,
                   batches: list[int] = DEFAULT_BATCHES) -> ExpertsReport:
    trace = trace_routing(model, tokens)
    counts = trace.counts()  # [L, E]
    per_layer = [trace.topk_ids(i) for i in range(len(trace.layers))]
    kept, measured, uniform = distinct_by_batch(per_layer, trace.num_experts, trace.top_k, batches)
    return ExpertsReport(model=name, source=tokens.name, tokens=trace.tokens, num_experts=trace.num_experts,
                         top_k=trace.top_k, layers=trace.layers, counts=counts.tolist(), imbalance=imbalance(counts),
                         distinct_batches=kept, distinct_measured=measured, distinct_uniform=uniform)


def render_experts_report(report: ExpertsReport, console: Console, skipped: list[int]) -> None:
    im = report.imbalance
    console.print(f"[bold]{report.model}[/]: {report.tokens} tokens ({report.source}), {len(report.layers)} MoE "
                  f"layers, E={report.num_experts}, k={report.top_k}")
    table = Table(title="load imbalance per MoE layer (even routing: max/mean 1, CV 0, entropy 1)")
    for column in ("layer", "max/mean", "CV", "entropy (bits)", "entropy / log2 E", "never chosen", "busiest"):
        table.add_column(column, justify="right")
    for i, layer in enumerate(report.layers):
        row = report.counts[i]
        busiest = max(range(len(row)), key=row.__getitem__)
        table.add_row(str(layer), f"{im.max_over_mean[i]:.2f}", f"{im.cv[i]:.2f}", f"{im.entropy[i]:.2f}",
                      f"{im.entropy_norm[i]:.3f}", f"{im.never_chosen[i]} / {report.num_experts}",
                      f"#{busiest} ({row[busiest]})")
    console.print(table)
    table = Table(title="distinct experts per layer that B random tokens touch (a decode step reads each once)")
    for column in ("B", "measured", "uniform routing", "measured / uniform", "of E"):
        table.add_column(column, justify="right")
    for B, m, u in zip(report.distinct_batches, report.distinct_measured, report.distinct_uniform):
        table.add_row(str(B), f"{m:.2f}", f"{u:.2f}", f"{m / u:.3f}", f"{100 * m / report.num_experts:.0f}%")
    console.print(table)
    if skipped:
        console.print(f"[yellow]batch sizes {', '.join(map(str, skipped))} skipped: more than the {report.tokens} "
                      "tokens traced[/]")


def model_name(path: str | Path) -> str:
    """A short name for a checkpoint: its directory's name."""
    return Path(path).resolve().name
