"""Where a decode step's time goes: engine steps timed with every module of interest bracketed by hooks, each
interval charged to the innermost bracket open at the time (exclusive time), so the groups add up to the step.

    experts      cpumoe.FusedMoE (routing included)
    dense GEMMs  nn.Linear, PackedLinear, QuantizedLinear (attention projections, routers, shared experts, lm_head)
    attention    the attention maths over the paged cache (paged_attention and what it calls)
    glue         the rest of the model's forward: norms, residual adds, RoPE, the KV-cache write, reshapes, routing
                 glue, allocations, and the Python between them
    engine       the step outside the model: scheduling, building the batch, sampling, detokenization
A decode step that runs fused (models/decode_layer.py: the whole step as one C++ call, or one a layer) has no
modules to hook there: the fused layers time their own GEMMs, attention and experts, the whole step its lm_head, and
the profile moves that time out of glue.

Hooks cost a few microseconds per module call; the report gives the profiled step beside an unprofiled one so
that cost shows. The attention functions are wrapped by name in the modules that call them, for the duration of a
profile only."""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
from rich.table import Table
from torch import nn

from cpumoe.bench.model import ModelCase, engine_config
from cpumoe.engine import LLMEngine, SamplingParams
from cpumoe.layer import FusedMoE
from cpumoe.attention import paged
from cpumoe.models import blocks
from cpumoe.models.packed_linear import PackedLinear, QuantizedLinear

GROUPS = ("experts", "dense GEMMs", "attention", "glue", "engine")
MODULE_GROUPS: tuple[tuple[type, str], ...] = ((FusedMoE, "experts"), (nn.Linear, "dense GEMMs"),
                                              (PackedLinear, "dense GEMMs"), (QuantizedLinear, "dense GEMMs"))
# patched where they are looked up: the attention layer calls paged_attention, which calls the other two
ATTENTION_FUNCTIONS = ((blocks, "paged_attention"), (paged, "decode_attention"), (paged, "causal_attention"))


@dataclass
class StepClock:
    """Exclusive time per group over the intervals between open() and close() calls."""
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0.0))
    _stack: list[str] = field(default_factory=list)
    _mark: float = 0.0

    def start(self, outer: str) -> None:
        self._stack = [outer]
        self._mark = time.perf_counter()

    def open(self, group: str) -> None:
        self._charge()
        self._stack.append(group)

    def close(self) -> None:
        self._charge()
        self._stack.pop()

    def stop(self) -> None:
        self._charge()
        self._stack = []

    def _charge(self) -> None:
        now = time.perf_counter()
        if self._stack:
            self.seconds[self._stack[-1]] += now - self._mark
        self._mark = now


def module_group(module: nn.Module) -> str | None:
    for kind, group in MODULE_GROUPS:
        if isinstance(module, kind):
            return group
    return None


@contextlib.contextmanager
def bracketed(model: nn.Module, clock: StepClock) -> Iterator[None]:
    """Hooks on the model's modules of interest and wrappers on the attention functions, all removed on exit. The
    model's forward is bracketed as "glue", so time inside it that no inner bracket claims is glue."""
    handles = []

    def hooks(group: str) -> tuple[Callable, Callable]:
        return (lambda module, args: clock.open(group)), (lambda module, args, output: clock.close())

    for module in model.modules():
        group = "glue" if module is model else module_group(module)
        if group is not None:
            pre, post = hooks(group)
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    originals = []
    for owner, name in ATTENTION_FUNCTIONS:
        fn = getattr(owner, name)
        originals.append((owner, name, fn))
        setattr(owner, name, _timed(fn, clock))
    fused = fused_plans(model)
    for plan in fused:
        plan.set_timing(True)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for owner, name, fn in originals:
            setattr(owner, name, fn)
        for plan in fused:
            plan.set_timing(False)


def fused_plans(model: nn.Module) -> list:
    """The model's fused decode layers and its fused whole step (models/decode_layer.py), if its decode steps run
    them: each times its own parts (the step's clock leaves its layers' time to theirs)."""
    decoder = getattr(model, "model", None)
    step = getattr(model, "decode_step", None)
    return list(getattr(decoder, "decode_layers", None) or []) + ([step.plan] if step is not None else [])


def charge_fused_plans(model: nn.Module, clock: StepClock) -> None:
    """A fused layer or step is one call inside the model's forward, so the clock charged all of it to glue: move
    the parts its own clock gave to the GEMMs, attention and the experts (see decode_layer.inc, decode_model.inc),
    and restart that."""
    for plan in fused_plans(model):
        glue, dense, attention, experts = plan.times()
        for group, seconds in (("dense GEMMs", dense), ("attention", attention), ("experts", experts)):
            clock.seconds[group] += seconds
            clock.seconds["glue"] -= seconds
        plan.set_timing(True)


def _timed(fn: Callable, clock: StepClock) -> Callable:
    def wrapper(*args, **kwargs):
        clock.open("attention")
        try:
            return fn(*args, **kwargs)
        finally:
            clock.close()
    return wrapper


@dataclass
class StepProfile:
    batch: int
    context: int                  # tokens in each sequence's cache at the profiled steps (mean)
    steps: int
    step_ms: float                # median profiled step
    plain_step_ms: float          # median step without hooks, measured beside it
    groups_ms: dict[str, float]   # per step, median over the steps

    def share(self, group: str) -> float:
        return self.groups_ms[group] / sum(self.groups_ms.values())


def profile_decode(engine, batch: int, input_len: int, steps: int = 16, seed: int = 0) -> StepProfile:
    """Prefills `batch` random prompts of input_len tokens, then alternates plain and profiled decode steps."""
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=2 * steps + 4, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(torch.randint(0, vocab, (batch, input_len), generator=g).tolist()):
        engine.add_request(f"profile-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # prefill (possibly in chunks) until every sequence has its first token
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    clock = StepClock()
    plain, profiled, per_group = [], [], {group: [] for group in GROUPS}
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - t0)
        clock.seconds = dict.fromkeys(GROUPS, 0.0)
        with bracketed(engine.model, clock):
            clock.start("engine")
            t0 = time.perf_counter()
            engine.step()
            profiled.append(time.perf_counter() - t0)
            clock.stop()
            charge_fused_plans(engine.model, clock)
        for group in GROUPS:
            per_group[group].append(clock.seconds[group])
    while engine.has_unfinished():
        engine.step()
    return StepProfile(batch=batch, context=input_len + steps, steps=steps,
                       step_ms=statistics.median(profiled) * 1e3, plain_step_ms=statistics.median(plain) * 1e3,
                       groups_ms={g: statistics.median(v) * 1e3 for g, v in per_group.items()})


def run_profile(model_path, batches, input_len: int, *, dtype: torch.dtype | None = None, steps: int = 16) -> dict:
    """The decode-step profile of one checkpoint at each batch size (prompts of input_len tokens)."""
    cases = [ModelCase(b, input_len, 2 * steps + 4) for b in batches]
    engine = LLMEngine(model_path, dtype=dtype, config=engine_config(cases))
    profile_decode(engine, min(batches), input_len, steps=2)  # warm-up
    profiles = [profile_decode(engine, b, input_len, steps=steps) for b in batches]
    return dict(model=str(model_path), threads=torch.get_num_threads(), input_len=input_len,
                profiles=[dict(asdict(p), shares={g: p.share(g) for g in GROUPS}) for p in profiles])


def render_profile(report: dict, console) -> None:
    table = Table(title=f"decode step profile: {report['model']}, {report['threads']} threads, prompts of "
                        f"{report['input_len']} tokens (ms per step, median of the profiled steps; share of the step)",
                  title_justify="left")
    table.add_column("group")
    for p in report["profiles"]:
        table.add_column(f"batch {p['batch']}", justify="right", no_wrap=True)
    for group in GROUPS:
        table.add_row(group, *(f"{p['groups_ms'][group]:.2f} ms  {100 * p['shares'][group]:4.1f}%"
                               for p in report["profiles"]))
    table.add_row("step, profiled", *(f"{p['step_ms']:.2f} ms" for p in report["profiles"]))
    table.add_row("step, no hooks", *(f"{p['plain_step_ms']:.2f} ms" for p in report["profiles"]))
    console.print(table)
