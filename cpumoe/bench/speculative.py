"""Speculative decoding in the model benchmark: each speculative config against none, on one engine, in the same run.

    per case (batch B, input length, output length) and prompt kind
      ("random": uniform random ids; "repeated": one random 32-token phrase over and over, what prompt lookup finds):
      greedy, output_len tokens, ignore_eos; the configs (none first) run in turn, `repeats` times round-robin
      decode tok/s       tokens the B requests gained in the steps where all of them decode / those steps' time
                         (the proposer's time included)
      acceptance         accepted drafts / drafts verified
      tokens per step    tokens a sequence gains per decode step (1 without speculation)
      experts per layer  distinct experts a decode step's tokens read, per MoE layer (measured): a verification
                         step over k + 1 tokens reads more of them than a step over one, the cost speculation pays
                         in an MoE model (MoE-Inference-Bench's speculative-decoding study)
      bound              what speculation could gain if a step cost its bytes: tokens per step x bytes of a plain
                         step / (bytes of a verification step (dense weights + the experts it read + KV) + a draft
                         model's k single-token steps)
      speed-up           decode tok/s over the no-speculation run of the same repetition
      routed apart       the experts per layer and the bound had the k + 1 tokens of a verification step each been
                         routed independently (uniformly), as different tokens of a trained model are: a random-weight
                         checkpoint's greedy output often loops on one token, whose drafts all read the same experts
Greedy tokens with and without speculation agree in float32; the report gives the share that agreed before the
first difference.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch
from rich.console import Console
from rich.table import Table

from cpumoe.bench.machine import cpu_model
from cpumoe.bench.model import (ExpertCounter, ModelCase, WeightBytes, engine_config, model_weight_bytes, weight_bytes,
                                weights_format)
from cpumoe.engine import LLMEngine
from cpumoe.engine.api import SamplingParams
from cpumoe.engine.config import SpeculativeConfig

PROMPT_KINDS = ("random", "repeated")
PHRASE = 32  # tokens of the phrase a "repeated" prompt repeats


@dataclass(slots=True)
class SpecResult:
    method: str             # "none", "ngram", "draft"
    k: int                  # drafts per step asked for (0: none)
    batch: int
    input_len: int
    output_len: int
    prompt: str
    decode_tok_s: float
    acceptance: float       # accepted / drafted (nan without drafts)
    tokens_per_step: float
    experts_per_layer: float
    step_bytes: float       # bytes a decode step reads (mean)
    same_prefix: float      # the share of greedy tokens equal to those without speculation before the first that
                            # differs (least over requests and repetitions): 1 in float32; in bf16 a near tie can
                            # flip where a (k + 1)-token step sums in another order than a 1-token step


def make_prompts(kind: str, batch: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed * 7919 + batch * 131 + input_len)
    if kind == "random":
        return torch.randint(0, vocab, (batch, input_len), generator=g).tolist()
    phrases = torch.randint(0, vocab, (batch, PHRASE), generator=g)
    return phrases.repeat(1, -(-input_len // PHRASE))[:, :input_len].tolist()


def run_spec_case(engine: LLMEngine, prompts: list[list[int]], output_len: int,
                  weights: WeightBytes) -> tuple[dict, list[list[int]]]:
    """One batch to completion; its decode figures, and every request's tokens."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    before = engine.stats()
    ids = [f"spec-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    started = set()
    seconds = gained = steps = 0
    step_bytes, experts = [], []
    context = len(prompts[0]) + output_len / 2
    with ExpertCounter(engine.model) as counter:
        while engine.has_unfinished():
            decoding = len(started) == len(ids) and all(len(t) < output_len for t in tokens.values())
            counter.counting = decoding
            t0 = time.perf_counter()
            outputs = engine.step()
            t1 = time.perf_counter()
            for out in outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.new_token_ids:
                    started.add(out.request_id)
            chosen = counter.take()
            if decoding:
                seconds += t1 - t0
                steps += 1
                gained += sum(len(out.new_token_ids) for out in outputs)
                per_layer = weights.distinct_experts(len(prompts)) if chosen is None else chosen
                experts.append(per_layer)
                step_bytes.append(weights.decode_step_bytes(len(prompts), context, per_layer))
    after = engine.stats()
    drafted = after.get("draft_tokens", 0) - before.get("draft_tokens", 0)
    accepted = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
    figures = dict(decode_tok_s=gained / seconds if seconds else float("nan"),
                   acceptance=accepted / drafted if drafted else float("nan"),
                   tokens_per_step=gained / (steps * len(prompts)) if steps else float("nan"),
                   experts_per_layer=statistics.mean(experts) if experts else float("nan"),
                   step_bytes=statistics.mean(step_bytes) if step_bytes else float("nan"))
    return figures, [tokens[rid] for rid in ids]


def run_speculative_bench(model_path, cases: Sequence[ModelCase], configs: Sequence[SpeculativeConfig], *,
                          prompt_kinds: Sequence[str] = ("random",), dtype: torch.dtype | None = None,
                          repeats: int = 3, progress: Console | None = None) -> dict:
    """One engine; each config's proposer made once (a draft model loaded once for every k), then every case runs
    with no speculation and with each config in turn, `repeats` times."""
    engine = LLMEngine(model_path, dtype=dtype, config=engine_config(cases))
    weights = weight_bytes(engine)
    proposers: dict[tuple, object] = {}
    setups: list[tuple[SpeculativeConfig | None, object]] = [(None, None)]
    draft_weights: dict[str, WeightBytes] = {}
    for c in configs:
        key = (c.method, c.model, c.prompt_lookup_min, c.prompt_lookup_max)
        if key not in proposers:
            proposers[key] = engine.make_proposer(c)
            if c.model is not None:
                draft = proposers[key].runner.kv_cache
                draft_weights[c.model] = model_weight_bytes(
                    proposers[key].model, kv_per_token=draft.layout.bytes_per_token(
                        num_layers=len(draft.layers), dtype=draft.layers[0][0].dtype))
        setups.append((c, proposers[key]))
    vocab = engine.model.config.vocab_size
    runs: dict[tuple, list[tuple[dict, list]]] = {}
    for rep in range(repeats + 1):  # the first pass warms up
        if progress is not None:
            progress.print(f"[dim]{'warm-up' if rep == 0 else f'repetition {rep} of {repeats}'}: {len(cases)} cases "
                           f"x {len(prompt_kinds)} prompts x {len(setups)} configs[/]")
        for case in cases:
            for kind in prompt_kinds:
                prompts = make_prompts(kind, case.batch, case.input_len, vocab, seed=max(rep, 1))
                for i, (config, proposer) in enumerate(setups):
                    engine.set_speculative(config, proposer)
                    gc.collect()
                    result = run_spec_case(engine, prompts, case.output_len, weights)
                    if rep > 0:
                        runs.setdefault((case, kind, i), []).append(result)
    engine.set_speculative(None)
    results = []
    for case in cases:
        for kind in prompt_kinds:
            base = runs[(case, kind, 0)]
            for i, (config, _) in enumerate(setups):
                rs = runs[(case, kind, i)]
                speedups = sorted(r[0]["decode_tok_s"] / b[0]["decode_tok_s"] for r, b in zip(rs, base))
                median = {key: statistics.median(r[0][key] for r in rs) for key in rs[0][0]}
                result = SpecResult(method="none" if config is None else config.method,
                                    k=0 if config is None else config.num_speculative_tokens, batch=case.batch,
                                    input_len=case.input_len, output_len=case.output_len, prompt=kind,
                                    same_prefix=min(_same_prefix(r[1], b[1]) for r, b in zip(rs, base)), **median)
                plain_bytes = statistics.median(b[0]["step_bytes"] for b in base)
                drafting = 0.0
                if config is not None and config.model is not None:
                    context = case.input_len + case.output_len / 2
                    drafting = config.num_speculative_tokens * draft_weights[config.model].decode_step_bytes(
                        case.batch, context)
                # had the k + 1 tokens of a verification been routed independently (as a trained model's different
                # tokens are), not as this checkpoint's: the experts they would read, and the bound that leaves
                k1 = case.batch * (result.k + 1)
                uniform_bytes = weights.decode_step_bytes(k1, case.input_len + case.output_len / 2) - \
                    (k1 - case.batch) * (case.input_len + case.output_len / 2) * weights.kv_per_token
                results.append(dict(asdict(result), speedup=statistics.median(speedups),
                                    speedup_min=speedups[0], speedup_max=speedups[-1], draft_bytes=drafting,
                                    bound=result.tokens_per_step * plain_bytes / (result.step_bytes + drafting),
                                    uniform_experts_per_layer=weights.distinct_experts(k1),
                                    uniform_bound=result.tokens_per_step * plain_bytes / (uniform_bytes + drafting)))
    return dict(model=str(model_path), weights_format=weights_format(engine), cpu=cpu_model(),
                threads=torch.get_num_threads(), repeats=repeats,
                configs=[None if c is None else asdict(c) for c, _ in setups], results=results)


def _same_prefix(tokens: list[list[int]], base: list[list[int]]) -> float:
    """The least share, over requests, of tokens equal to base's before the first that differs."""
    shares = []
    for t, b in zip(tokens, base):
        n = next((i for i, (x, y) in enumerate(zip(t, b)) if x != y), min(len(t), len(b)))
        shares.append(n / max(len(b), 1) if len(t) == len(b) or n < min(len(t), len(b)) else 0.0)
    return min(shares, default=1.0)


def with_k(configs: Sequence[SpeculativeConfig], ks: Sequence[int] | None) -> list[SpeculativeConfig]:
    """Each config at each k of ks (the configs' own k when ks is None)."""
    return [replace(c, num_speculative_tokens=k) for c in configs for k in ks] if ks else list(configs)


def render_speculative_report(report: dict, console: Console) -> None:
    console.print(f"[bold]{report['model']}[/]  weights [bold]{report['weights_format']}[/]  CPU {report['cpu']}  "
                  f"threads {report['threads']}  greedy, {report['repeats']} repetitions (speed-up: median and range "
                  f"over them, against no speculation in the same repetition)")
    for case in dict.fromkeys((r["batch"], r["input_len"], r["output_len"], r["prompt"]) for r in report["results"]):
        table = Table(title=f"speculative decoding: batch {case[0]}, input {case[1]}, output {case[2]}, {case[3]} "
                            "prompts (bound: tokens per step x plain-step bytes / (verification-step bytes + drafting "
                            "bytes); apart: had the k + 1 tokens been routed independently)", title_justify="left")
        for name in ("method", "k", "accepted", "tokens/step", "experts/layer", "decode tok/s", "speed-up", "range",
                     "bound", "experts apart", "bound apart", "same tokens"):
            table.add_column(name, justify="right", no_wrap=True)
        for r in report["results"]:
            if (r["batch"], r["input_len"], r["output_len"], r["prompt"]) != case:
                continue
            spec = r["method"] != "none"
            table.add_row(r["method"], str(r["k"]) if spec else "-", f"{r['acceptance']:.0%}" if spec else "-",
                          f"{r['tokens_per_step']:.2f}", f"{r['experts_per_layer']:.1f}", f"{r['decode_tok_s']:.1f}",
                          f"{r['speedup']:.2f}x", f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}",
                          f"{r['bound']:.2f}x", f"{r['uniform_experts_per_layer']:.1f}", f"{r['uniform_bound']:.2f}x",
                          f"{r['same_prefix']:.0%}")
        console.print(table)
