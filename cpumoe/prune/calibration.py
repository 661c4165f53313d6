"""Routing counts of a calibration set, the input of inter-expert pruning: the source model (cpumoe's loader)
routes every calibration sequence in one prefill each under a RoutingTrace (cpumoe/bench/activation)."""
from __future__ import annotations

from pathlib import Path

import torch

from cpumoe.bench.activation.run import trace_routing
from cpumoe.bench.activation.tokens import DEFAULT_MAX_LEN, token_set


def calibration_counts(src: str | Path, *, text: str | Path | None = None, random: int | None = None,
                       max_len: int = DEFAULT_MAX_LEN) -> tuple[dict[int, torch.Tensor], str, int]:
    """-> (decoder layer -> [E] tokens that chose each expert, the token set's name, tokens routed)."""
    from cpumoe.models import load_model

    model = load_model(src)
    tokens = token_set(src, model.config.vocab_size, text=text, random=random, max_len=max_len)
    trace = trace_routing(model, tokens)
    counts = trace.counts()  # [L, E]
    return {layer: counts[i] for i, layer in enumerate(trace.layers)}, tokens.name, tokens.tokens
