"""The model benchmark: the offline engine on random prompts of fixed lengths, MoE-Inference-Bench metrics.

    per (batch B, input length, output length): B random prompts, max_tokens = output length, ignore_eos
      -> engine.step() until all finish, timing every step
      TTFT       mean over the B requests of (first token - requests added)
      ITL        (E2E - TTFT) / (B x (output - 1))                      (../shared/workloads.md)
      throughput B x (input + output) / E2E
      decode     median time of the steps where every request decodes: tokens/s, and bytes read per step
                 (dense weights + the distinct experts the step's tokens chose, counted + KV cache) / time,
                 against the mean of 1 GiB streaming-read probes taken right before and right after the case (a
                 shared machine's bandwidth drifts within minutes; both are in the JSON)
      prefill    2 FLOPs per active weight per prompt token, the lm_head once per prompt (attention's FLOPs not
                 counted) / (time to the last first token), against a torch.mm of 4096^3 in the model dtype
                 taken right before the case
      memory     peak RSS while loading and while serving each case, against the checkpoint's size (+ KV cache)
      scaling    decode tokens/s at batch B over batch 1, beside the bound of the weight bytes each step reads
With `--compare naive` a second engine runs the experts on the naive backend, after the first one's cases and with
the first engine freed, so each engine's load peak and serving peak are its own.
Several checkpoints (one and its `cpumoe quantize` twins) stay loaded together: each runs every case on its own as
above, and the speed-ups against the first come from decode steps and prefills that the checkpoints run in turn.
Peak RSS: VmHWM of /proc/self/status, reset (clear_refs) before each load and each case; ru_maxrss where
that is not available (then a process-wide high-water mark).
"""
from __future__ import annotations

import dataclasses
import gc
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table

from cpumoe import ops
from cpumoe.bench.machine import cpu_model
from cpumoe.engine import LLMEngine
from cpumoe.engine.api import SamplingParams
from cpumoe.engine.config import EngineConfig
from cpumoe.loader import Checkpoint
from cpumoe.memory import current_rss_gb, proc_gb
from cpumoe.models.blocks import MoEBlock
from cpumoe.models.packed_linear import PackedLinear, QuantizedLinear
from cpumoe.routing import select_experts
from cpumoe.torch_gemm import gemm_dtype

MM_SIZE = 4096
REPEATS = 3            # round-robin repetitions of every case
FLOAT_FORMATS = ("bf16", "fp16", "fp32")   # weights the mm probe's rate applies to (weights_format's names)
PREFILL_PROMPTS = 4    # prefills per case and repetition that every checkpoint runs in turn (bench of several)
QUICK_MM_SIZE = 1024


@dataclass(frozen=True, slots=True)
class ModelCase:
    batch: int
    input_len: int
    output_len: int


@dataclass(slots=True)
class ModelResult:
    backend: str
    batch: int
    input_len: int
    output_len: int
    ttft_ms: float
    itl_ms: float
    e2e_s: float
    throughput_tok_s: float
    decode_tok_s: float
    decode_gbs: float
    decode_experts_per_layer: float  # distinct experts per MoE layer in a decode step (measured)
    decode_bandwidth_pct: float
    bandwidth_gbs: float           # what decode_bandwidth_pct is of: the mean of the probes around the case
    prefill_gflops: float
    prefill_mm_pct: float
    mm_gflops: float
    peak_rss_gb: float
    bandwidth_before_gbs: float = float("nan")  # the read probe right before the case
    bandwidth_after_gbs: float = float("nan")   # and right after it


@dataclass(frozen=True, slots=True)
class WeightBytes:
    """What a step reads and a token computes, from the loaded model. Bytes are those the kernels stream: the
    packed (quantized, for a quantized checkpoint) weights, scales included."""
    dense_elems: int      # every weight but the embedding table and the experts (all read once per step)
    expert_elems: int     # one expert's w13 + w2
    dense: int            # their bytes as held
    expert: int           # one expert's bytes as packed
    moe_layers: int
    experts: int          # E
    top_k: int
    kv_per_token: int     # bytes of K and V of one token, all layers
    head_elems: int = 0   # the lm_head's (in dense_elems): a prefill computes it for the last token only

    def distinct_experts(self, tokens: int) -> float:
        """Expected distinct experts per layer for `tokens` uniformly routed tokens."""
        return self.experts * (1 - (1 - self.top_k / self.experts) ** tokens)

    def decode_step_bytes(self, batch: int, mean_context: float, experts_per_layer: float | None = None) -> float:
        """experts_per_layer: distinct experts a step's tokens chose (measured); None: uniform routing's."""
        per_layer = self.distinct_experts(batch) if experts_per_layer is None else experts_per_layer
        return self.dense + self.moe_layers * per_layer * self.expert + batch * mean_context * self.kv_per_token

    def decode_step_floor_s(self, batch: int, mean_context: float, experts_per_layer: float | None,
                            bandwidth_gbs: float, gemm_gflops: float | None) -> float:
        """The least time a decode step can take, in seconds (step_floor_s of `batch` tokens, each sampled)."""
        return self.step_floor_s(batch, batch, batch * mean_context, experts_per_layer, bandwidth_gbs, gemm_gflops)

    def step_floor_s(self, tokens: int, sampled: int, kv_tokens: float, experts_per_layer: float | None,
                     bandwidth_gbs: float, gemm_gflops: float | None) -> float:
        """The least time a step of `tokens` tokens can take, in seconds: `sampled` of them get logits (the lm_head
        runs for those only) and kv_tokens keys are read from the cache. The dense weights and then the experts run
        one after the other, each for the longer of its bytes at the read bandwidth and its FLOPs (2 a weight a
        token) at the GEMM rate; the KV cache is read at the bandwidth. Attention's arithmetic is not counted, so
        this stays a bound. gemm_gflops None: bytes only (what decode_step_bytes gives, as time)."""
        bw = bandwidth_gbs * 1e9
        per_layer = self.distinct_experts(tokens) if experts_per_layer is None else experts_per_layer
        dense_s, experts_s = self.dense / bw, self.moe_layers * per_layer * self.expert / bw
        if gemm_gflops is not None:
            rate = gemm_gflops * 1e9
            dense_s = max(dense_s, 2.0 * ((self.dense_elems - self.head_elems) * tokens
                                          + self.head_elems * sampled) / rate)
            experts_s = max(experts_s, 2.0 * tokens * self.moe_layers * self.top_k * self.expert_elems / rate)
        return dense_s + experts_s + kv_tokens * self.kv_per_token / bw

    def active_weights(self) -> int:
        """Weights one token multiplies: dense ones and k experts per MoE layer (in elements)."""
        return self.dense_elems + self.moe_layers * self.top_k * self.expert_elems

    def prefill_flops(self, batch: int, input_len: int) -> float:
        """2 FLOPs per active weight per prompt token, the lm_head once per prompt (only its last token's logits)."""
        return self.step_flops(batch * input_len, batch)

    def step_flops(self, tokens: int, sampled: int) -> float:
        """2 FLOPs per active weight per token, the lm_head's only for the `sampled` tokens that get logits."""
        return 2.0 * ((self.active_weights() - self.head_elems) * tokens + self.head_elems * sampled)


def weight_bytes(engine: LLMEngine) -> WeightBytes:
    return model_weight_bytes(engine.model, kv_per_token=_kv_bytes_per_token(engine))


def model_weight_bytes(model: torch.nn.Module, *, kv_per_token: int) -> WeightBytes:
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if not blocks:
        raise ValueError("the model has no MoE layer (only dense ones): the model benchmark measures MoE models")
    embed = model.model.embed_tokens.weight
    # Parameters, plus the projections packed for cpumoe's kernels (a buffer each; routers keep `.weight` too).
    packed = [m for m in model.modules()
              if (isinstance(m, PackedLinear) and m.weight is None) or isinstance(m, QuantizedLinear)]
    held = [m.packed_weight if m.packed_weight is not None else m.dense_weight for m in packed]
    dense_elems = sum(p.numel() for p in model.parameters()) + sum(m.in_features * m.out_features for m in packed) \
        - embed.numel()
    dense = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(t.nbytes for t in held) \
        - embed.nbytes
    if getattr(model.config, "tie_word_embeddings", False):
        dense_elems += embed.numel()  # the tied lm_head is read every step
        dense += embed.nbytes
    b = blocks[0]
    prepared = b.experts.prepared
    return WeightBytes(dense_elems=dense_elems, expert_elems=3 * b.hidden_size * b.inter_size, dense=dense,
                       expert=(prepared.w13.nbytes + prepared.w2.nbytes) // b.num_experts,
                       moe_layers=len(blocks), experts=b.num_experts,
                       top_k=b.top_k, kv_per_token=kv_per_token,
                       head_elems=model.config.vocab_size * model.config.hidden_size)


def _kv_bytes_per_token(engine: LLMEngine) -> int:
    return engine.kv_cache.layout.bytes_per_token(num_layers=engine.model.config.num_hidden_layers,
                                                  dtype=engine.dtype)


def experts_backend(engine: LLMEngine) -> str:
    return next(m.experts.backend for m in engine.model.modules() if isinstance(m, MoEBlock))


def weights_format(engine: LLMEngine) -> str:
    """The experts' format, and the dense projections' where they are quantized: "bf16", "int8_w8a8", ..."""
    experts = next(m.experts.quantization for m in engine.model.modules() if isinstance(m, MoEBlock))
    linears = {m.format.value for m in engine.model.modules() if isinstance(m, QuantizedLinear)}
    dtype = str(engine.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "fp")
    if experts == "none":
        return dtype
    return experts if linears == {experts} else f"{experts} experts, {'/'.join(sorted(linears)) or dtype} dense"


@dataclass(frozen=True, slots=True)
class MachineLimits:
    """This machine's read bandwidth (a streaming-read probe of probe_bytes) and GEMM rate (torch.mm of
    mm_size^3 in dtype, or in float32 where torch has no vector GEMM for dtype: cpumoe.torch_gemm), measured
    right before each case. Their buffers live only while measuring, so the case's peak RSS is the engine's own."""
    probe_bytes: int
    mm_size: int
    dtype: torch.dtype

    def measure(self) -> tuple[float, float]:
        """-> (read GB/s, median of 3 probes; mm GFLOP/s)."""
        bandwidth = self.measure_bandwidth()
        a = torch.randn(self.mm_size, self.mm_size).to(gemm_dtype(self.dtype))
        b = torch.randn(self.mm_size, self.mm_size).to(gemm_dtype(self.dtype))
        torch.mm(a, b)
        t = time.perf_counter()
        torch.mm(a, b)
        return bandwidth, 2 * self.mm_size**3 / (time.perf_counter() - t) / 1e9

    def measure_bandwidth(self) -> float:
        """Read GB/s, the median of 3 probes."""
        probe = ops.ReadBandwidthProbe(self.probe_bytes)
        bandwidth = statistics.median(probe.read_gbps() for _ in range(3))
        del probe
        return bandwidth


class ExpertCounter:
    """Counts the distinct experts each MoE layer's tokens choose while `counting` (forward hooks that redo the
    layer's routing on its router logits: cheap at decode sizes). `per_layer`: their mean over the layers."""

    def __init__(self, model: torch.nn.Module):
        self.layers = [m.experts for m in model.modules() if isinstance(m, MoEBlock) and m.experts is not None]
        self.counting, self.chosen, self.calls = False, 0, 0
        self._hooks = []
        # decode steps through fused layers (models/decode_layer.py) call no FusedMoE: they report their routing
        self._decoder = getattr(model, "model", None)

    def __enter__(self) -> "ExpertCounter":
        self._hooks = [layer.register_forward_hook(self._count) for layer in self.layers]
        if hasattr(self._decoder, "decode_routing_hooks"):
            self._decoder.decode_routing_hooks.append(self._count_ids)
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        if hasattr(self._decoder, "decode_routing_hooks"):
            self._decoder.decode_routing_hooks.remove(self._count_ids)

    def _count(self, layer, args, output) -> None:
        if self.counting and len(args) == 2:  # (hidden_states, router_logits)
            self._count_ids(select_experts(args[1], layer.top_k, **layer.routing)[1])

    def _count_ids(self, topk_ids: torch.Tensor) -> None:
        if self.counting:
            self.chosen += topk_ids.unique().numel()
            self.calls += 1

    def take(self) -> float | None:
        """Mean distinct experts per layer since the last take; None when no layer routed through FusedMoE's own
        forward (models whose MoE blocks route themselves)."""
        per_layer = self.chosen / self.calls if self.calls else None
        self.chosen = self.calls = 0
        return per_layer


def random_prompts(engine: LLMEngine, case: ModelCase, seed: int, g: torch.Generator | None = None) -> list[list[int]]:
    """The case's batch of random prompts of its input length: from `seed` (a run and its case), or drawn on from g."""
    if g is None:
        g = torch.Generator().manual_seed(seed * 7919 + case.batch * 131 + case.input_len)
    return torch.randint(0, engine.model.config.vocab_size, (case.batch, case.input_len), generator=g).tolist()


def run_case(engine: LLMEngine, case: ModelCase, limits: MachineLimits, weights: WeightBytes,
             seed: int = 0) -> ModelResult:
    prompts = random_prompts(engine, case, seed)
    params = SamplingParams(max_tokens=case.output_len, temperature=0, ignore_eos=True)
    bandwidth, mm_gflops = limits.measure()
    gc.collect()

    reset_peak_rss()
    start = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    decode_steps: list[tuple[float, float]] = []  # (seconds, bytes read)
    experts: list[float] = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
    with ExpertCounter(engine.model) as counter:
        while engine.has_unfinished():
            all_decoding = len(first) == case.batch and len(done) == 0
            counter.counting = all_decoding
            t0 = time.perf_counter()
            outputs = engine.step()
            t1 = time.perf_counter()
            for out in outputs:
                if out.new_token_ids and out.request_id not in first:
                    first[out.request_id] = t1 - start
                if out.finished:
                    done[out.request_id] = t1 - start
            chosen = counter.take()
            if all_decoding and len(outputs) == case.batch:
                context = case.input_len + statistics.mean(o.completion_tokens for o in outputs)
                decode_steps.append((t1 - t0, weights.decode_step_bytes(case.batch, context, chosen)))
                experts.append(weights.distinct_experts(case.batch) if chosen is None else chosen)
    e2e = max(done.values())
    ttft = statistics.mean(first.values())
    prefill_s = max(first.values())
    decode_s = statistics.median(t for t, _ in decode_steps) if decode_steps else float("nan")
    decode_gbs = statistics.median(b / t for t, b in decode_steps) / 1e9 if decode_steps else float("nan")
    prefill_gflops = weights.prefill_flops(case.batch, case.input_len) / prefill_s / 1e9
    peak_rss = peak_rss_gb()  # before the probe after the case allocates its buffer
    bandwidth_before, bandwidth_after = bandwidth, limits.measure_bandwidth()
    bandwidth = (bandwidth_before + bandwidth_after) / 2
    return ModelResult(
        backend=experts_backend(engine), batch=case.batch, input_len=case.input_len, output_len=case.output_len,
        ttft_ms=ttft * 1e3,
        itl_ms=(e2e - ttft) / (case.batch * max(case.output_len - 1, 1)) * 1e3,
        e2e_s=e2e, throughput_tok_s=case.batch * (case.input_len + case.output_len) / e2e,
        decode_tok_s=case.batch / decode_s, decode_gbs=decode_gbs,
        decode_experts_per_layer=statistics.mean(experts) if experts else float("nan"),
        decode_bandwidth_pct=100 * decode_gbs / bandwidth, bandwidth_gbs=bandwidth,
        bandwidth_before_gbs=bandwidth_before, bandwidth_after_gbs=bandwidth_after,
        prefill_gflops=prefill_gflops, prefill_mm_pct=100 * prefill_gflops / mm_gflops, mm_gflops=mm_gflops,
        peak_rss_gb=peak_rss)


def reset_peak_rss() -> None:
    """Start a new high-water mark of resident memory (Linux: clear_refs 5 resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_gb() -> float:
    """Resident memory high-water mark since the last reset_peak_rss (GB)."""
    peak = proc_gb("/proc/self/status", "VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def engine_config(cases: Sequence[ModelCase], block_size: int = 16) -> EngineConfig:
    """Room for the largest case's every sequence, and a step budget that prefills a batch in few steps. No prefix
    caching: a case that repeats its prompts measures their prefill each time."""
    blocks = max(c.batch * -(-(c.input_len + c.output_len) // block_size) for c in cases)
    return EngineConfig(block_size=block_size, num_blocks=blocks + max(c.batch for c in cases),
                        enable_prefix_caching=False,
                        max_num_seqs=max(c.batch for c in cases),
                        max_num_batched_tokens=max(1024, max(c.input_len for c in cases)),
                        max_model_len=max(c.input_len + c.output_len for c in cases))


def run_model_bench(model_path, cases: Sequence[ModelCase], *, dtype: torch.dtype | None = None,
                    compare_naive: bool = False, quick: bool = False, repeats: int = REPEATS,
                    progress: Console | None = None) -> dict:
    """quick: one repetition, a 256 MiB bandwidth probe and a 1024^3 mm (tests, smoke runs).

    Side by side: after a warm-up of each case, the cases run in turn `repeats` times and each reports its run of
    median end-to-end time, so ratios between cases (batch 16 against batch 1) come from the same minutes."""
    repeats = 1 if quick else repeats
    config = engine_config(cases)
    reset_peak_rss()
    engine = LLMEngine(model_path, dtype=dtype, config=config)
    load_rss = {"fused": peak_rss_gb()}
    weights = weight_bytes(engine)
    model_dtype, backend, fmt = engine.dtype, experts_backend(engine), weights_format(engine)
    limits = MachineLimits(probe_bytes=(256 << 20) if quick else (1 << 30),
                           mm_size=QUICK_MM_SIZE if quick else MM_SIZE, dtype=model_dtype)
    results = []
    for name in ["fused", "naive"] if compare_naive else ["fused"]:
        if name == "naive":  # one engine at a time: free the first before loading the second
            del engine
            gc.collect()
            reset_peak_rss()
            engine = LLMEngine(model_path, dtype=dtype, backend="naive", config=config)
            load_rss[name] = peak_rss_gb()
        for case in cases:
            if progress is not None:
                progress.print(f"[dim]{name}: warm-up, batch {case.batch}, input {case.input_len}[/]")
            run_case(engine, case, limits, weights)
        runs: dict[ModelCase, list[ModelResult]] = {case: [] for case in cases}
        for rep in range(repeats):
            if progress is not None:
                progress.print(f"[dim]{name}: repetition {rep + 1} of {repeats} over {len(cases)} cases[/]")
            for case in cases:
                runs[case].append(run_case(engine, case, limits, weights, seed=1 + rep))
        results += [sorted(rs, key=lambda r: r.e2e_s)[len(rs) // 2] for rs in runs.values()]
    order = {c: i for i, c in enumerate(cases)}
    results.sort(key=lambda r: order[ModelCase(r.batch, r.input_len, r.output_len)])  # case by case (stable)
    return dict(model=str(model_path), dtype=str(model_dtype).removeprefix("torch."), cpu=cpu_model(),
                threads=torch.get_num_threads(), features=ops.cpu_features(), experts_backend=backend,
                weights_format=fmt,
                weights=dict(asdict(weights), dense=weights.dense, expert=weights.expert),
                load_peak_rss_gb=load_rss["fused"], load_peak_rss_gb_by_engine=load_rss,
                checkpoint_gb=Checkpoint(model_path).weights_bytes / 1e9,
                kv_cache_gb=config.num_blocks * config.block_size * weights.kv_per_token / 1e9,
                results=[asdict(r) for r in results],
                batch_scaling=batch_scaling(results, weights, count_compute=fmt in FLOAT_FORMATS))


def time_prefill(engine: LLMEngine, prompts: list[list[int]]) -> float:
    """Seconds to prefill `prompts` together and sample each one token."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"prefill-{i}", prompt, params)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def interleaved_prefills(engines: Sequence[LLMEngine], case: ModelCase, prompts: int, seed: int) -> list[list[float]]:
    """Per engine, the seconds of `prompts` prefills of the case's batch and input length, each prompt prefilled by
    every engine in turn: each ratio between engines then comes from the same few seconds."""
    g = torch.Generator().manual_seed(104729 + seed)  # prompts of their own, not the cases'
    seconds: list[list[float]] = [[] for _ in engines]
    for _ in range(prompts):
        batch = random_prompts(engines[0], case, seed, g)
        for engine, times in zip(engines, seconds):
            times.append(time_prefill(engine, batch))
    return seconds


def interleaved_decode(engines: Sequence[LLMEngine], case: ModelCase, seed: int) -> list[list[float]]:
    """Per engine, the seconds of each decode step of the case (its batch of prompts, each decoding to the output
    length), the engines stepping in turn: step i of one and step i of the next ran milliseconds apart, where one
    case after another would be a minute apart. The prefill steps are not timed."""
    prompts = random_prompts(engines[0], case, seed, torch.Generator().manual_seed(611953 + seed))
    params = SamplingParams(max_tokens=case.output_len, temperature=0, ignore_eos=True)
    for engine in engines:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"decode-{i}", prompt, params)
        started: set[str] = set()
        while len(started) < case.batch and engine.has_unfinished():
            started.update(out.request_id for out in engine.step() if out.new_token_ids)
    seconds: list[list[float]] = [[] for _ in engines]
    while any(engine.has_unfinished() for engine in engines):
        for engine, times in zip(engines, seconds):
            if engine.has_unfinished():
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
    return seconds


def run_formats_bench(model_paths: Sequence, cases: Sequence[ModelCase], *, dtype: torch.dtype | None = None,
                      quick: bool = False, repeats: int = REPEATS, progress: Console | None = None,
                      batch_invariant: Sequence[bool] | None = None, prefill_prompts: int = PREFILL_PROMPTS) -> dict:
    """Several checkpoints of one model (bf16 and its quantized twins from `cpumoe quantize`) side by side: all
    engines stay loaded and every repetition runs each case on each in turn, so the ratios to the first checkpoint
    come from the same minutes. The speed-ups come from more runs of each case per repetition, interleaved: decode
    from the checkpoints stepping in turn, prefill from `prefill_prompts` prompts each prefilled by every checkpoint
    in turn (a case's own TTFT and ITL are one sample each of a machine whose speed moves by tens of percent from
    one second to the next). Beside each decode ratio, the most a weight stream allows: the first checkpoint's
    decode-step bytes over this one's. Memory: each engine's load is measured as the resident growth and peak while
    it loads (the others already resident); per-case peaks hold every engine.
    batch_invariant: per checkpoint, its engine's EngineConfig.batch_invariant (a path may come twice, to measure
    the mode's cost; its rows are labelled "invariant")."""
    repeats, prefill_prompts = (1, 1) if quick else (repeats, prefill_prompts)
    config = engine_config(cases)
    engines, models = [], []
    for path, invariant in zip(model_paths, batch_invariant or [False] * len(model_paths)):
        before = current_rss_gb()
        reset_peak_rss()
        engine = LLMEngine(path, dtype=dtype, config=dataclasses.replace(config, batch_invariant=invariant))
        peak, after = peak_rss_gb(), current_rss_gb()
        weights = weight_bytes(engine)
        engines.append((engine, weights))
        label = weights_format(engine) + (" invariant" if invariant else "")
        models.append(dict(model=str(path), weights_format=label, experts_backend=experts_backend(engine),
                           checkpoint_gb=Checkpoint(path).weights_bytes / 1e9, load_rss_gb=after - before,
                           load_peak_over_start_gb=peak - before, packed_gb=engine.model.huge_pages.advised_gb,
                           packed_huge_pages_gb=engine.model.huge_pages.huge_gb,
                           weights=dict(asdict(weights)), dtype=str(engine.dtype).removeprefix("torch.")))
    limits = MachineLimits(probe_bytes=(256 << 20) if quick else (1 << 30),
                           mm_size=QUICK_MM_SIZE if quick else MM_SIZE, dtype=engines[0][0].dtype)
    for (engine, weights), m in zip(engines, models):
        for case in cases:
            if progress is not None:
                progress.print(f"[dim]{m['weights_format']}: warm-up, batch {case.batch}, input {case.input_len}[/]")
            run_case(engine, case, limits, weights)
    runs: dict[tuple[int, ModelCase], list[ModelResult]] = {}
    prefills: dict[tuple[int, ModelCase], list[list[float]]] = {}
    decodes: dict[tuple[int, ModelCase], list[list[float]]] = {}
    for rep in range(repeats):
        if progress is not None:
            progress.print(f"[dim]repetition {rep + 1} of {repeats}: {len(cases)} cases x {len(engines)} checkpoints[/]")
        for case in cases:
            for i, (engine, weights) in enumerate(engines):
                runs.setdefault((i, case), []).append(run_case(engine, case, limits, weights, seed=1 + rep))
            plain = [e for e, _ in engines]
            for i, times in enumerate(interleaved_prefills(plain, case, prefill_prompts, seed=1 + rep)):
                prefills.setdefault((i, case), []).append(times)
            for i, times in enumerate(interleaved_decode(plain, case, seed=1 + rep)):
                decodes.setdefault((i, case), []).append(times)
    results = []
    for case in cases:
        for i, m in enumerate(models):
            rs = runs[(i, case)]
            results.append(dict(asdict(sorted(rs, key=lambda r: r.e2e_s)[len(rs) // 2]), model=i,
                                weights_format=m["weights_format"],
                                prefill_interleaved_ms=1e3 * statistics.median(sum(prefills[(i, case)], [])),
                                decode_step_interleaved_ms=1e3 * statistics.median(sum(decodes[(i, case)], []))))
    return dict(cpu=cpu_model(), threads=torch.get_num_threads(), features=ops.cpu_features(), models=models,
                kv_cache_gb=config.num_blocks * config.block_size * engines[0][1].kv_per_token / 1e9,
                results=results,
                comparison=format_comparison(results, runs, [w for _, w in engines], prefills, decodes))


def paired_speedup(base: Sequence[Sequence[float]], other: Sequence[Sequence[float]]) -> tuple[float, tuple, int]:
    """Seconds per repetition, the i-th of `base` and of `other` run back to back -> (median of all the pairs'
    ratios base / other, range of the repetitions' medians, number of pairs)."""
    per_rep = [[a / b for a, b in zip(ra, rb)] for ra, rb in zip(base, other)]
    medians = [statistics.median(r) for r in per_rep]
    return statistics.median(sum(per_rep, [])), (min(medians), max(medians)), sum(map(len, per_rep))


def format_comparison(results: Sequence[dict], runs: dict[tuple[int, ModelCase], list[ModelResult]],
                      weights: Sequence[WeightBytes],
                      prefills: dict[tuple[int, ModelCase], list[list[float]]] | None = None,
                      decodes: dict[tuple[int, ModelCase], list[list[float]]] | None = None) -> list[dict]:
    """Each checkpoint's case against the first checkpoint's same case: decode and prefill speed-ups, and the
    decode bound (bytes of the first's decode step over this one's, at this case's measured routing).

    prefills, decodes: per (checkpoint, case) and repetition, the seconds of prefills and decode steps that every
    checkpoint ran in turn (interleaved_prefills, interleaved_decode): a speed-up is then the median of the ratios
    of those pairs, which ran seconds apart, and its range that of the repetitions' medians. Without them it pairs
    the cases' own runs: the median over repetitions of the ratio within each, where the two ran a minute apart.
    Either way the ratios are taken pair by pair: the machine's speed drifts between repetitions by more than the
    formats differ (a 512-token bf16 prefill measured 0.8 s and 1.3 s in one run), so a ratio of two medians
    taken from different repetitions reads that drift as a speed-up."""
    by_key = {(c.batch, c.input_len, c.output_len): c for _, c in runs}
    first = {(r["batch"], r["input_len"], r["output_len"]): r for r in results if r["model"] == 0}
    rows = []
    for r in results:
        key = (r["batch"], r["input_len"], r["output_len"])
        if r["model"] == 0:
            continue
        base, case = first[key], by_key[key]
        context = r["input_len"] + r["output_len"] / 2
        bound = weights[0].decode_step_bytes(r["batch"], context, base["decode_experts_per_layer"]) / \
            weights[r["model"]].decode_step_bytes(r["batch"], context, r["decode_experts_per_layer"])
        pairs = list(zip(runs[(0, case)], runs[(r["model"], case)]))
        if decodes:
            decode, decode_range, decode_pairs = paired_speedup(decodes[(0, case)], decodes[(r["model"], case)])
        else:
            ratios = [b.decode_tok_s / a.decode_tok_s for a, b in pairs]
            decode, decode_range, decode_pairs = statistics.median(ratios), (min(ratios), max(ratios)), len(ratios)
        if prefills:
            prefill, prefill_range, prefill_pairs = paired_speedup(prefills[(0, case)], prefills[(r["model"], case)])
        else:
            ratios = [b.prefill_gflops / a.prefill_gflops for a, b in pairs]
            prefill, prefill_range, prefill_pairs = statistics.median(ratios), (min(ratios), max(ratios)), len(ratios)
        rows.append(dict(weights_format=r["weights_format"], model=r["model"], batch=r["batch"],
                         input_len=r["input_len"], output_len=r["output_len"],
                         decode_speedup=decode, decode_speedup_range=decode_range, decode_pairs=decode_pairs,
                         decode_bound=bound,
                         prefill_speedup=prefill, prefill_speedup_range=prefill_range, prefill_pairs=prefill_pairs,
                         ttft_ratio=base["ttft_ms"] / r["ttft_ms"]))
    return rows


def render_formats_report(report: dict, console: Console) -> None:
    console.print(f"CPU {report['cpu']}  threads {report['threads']}  KV cache {report['kv_cache_gb']:.2f} GB each")
    models = Table(title="checkpoints (loaded together; memory is each one's growth while it loads, and its peak "
                         "over the start of its load; huge pages: the share of its packed weights on 2 MB pages, which "
                         "a weight stream reads faster)", title_justify="left")
    for name in ("#", "weights", "experts backend", "checkpoint GB", "dense GB", "expert MB", "loaded GB",
                 "x checkpoint", "load peak GB", "peak x ckpt", "huge pages"):
        models.add_column(name, justify="right", no_wrap=True)
    for i, m in enumerate(report["models"]):
        w = m["weights"]
        models.add_row(str(i), m["weights_format"], m["experts_backend"], f"{m['checkpoint_gb']:.2f}",
                       f"{w['dense'] / 1e9:.2f}", f"{w['expert'] / 1e6:.2f}", f"{m['load_rss_gb']:.2f}",
                       f"{m['load_rss_gb'] / m['checkpoint_gb']:.2f}x", f"{m['load_peak_over_start_gb']:.2f}",
                       f"{m['load_peak_over_start_gb'] / m['checkpoint_gb']:.2f}x",
                       f"{m['packed_huge_pages_gb'] / m['packed_gb']:.0%}" if m["packed_gb"] > 0 else "-")
    console.print(models)
    table = Table(title="side by side (each case on each checkpoint in turn, every repetition)", title_justify="left")
    for name in ("batch", "in", "out", "weights", "TTFT ms", "ITL ms", "decode tok/s", "decode GB/s", "% bw",
                 "prefill GFLOP/s", "% mm", "in turn: prefill ms", "step ms"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in report["results"]:
        table.add_row(str(r["batch"]), str(r["input_len"]), str(r["output_len"]), r["weights_format"],
                      f"{r['ttft_ms']:.1f}", f"{r['itl_ms']:.2f}", f"{r['decode_tok_s']:.1f}", f"{r['decode_gbs']:.1f}",
                      f"{r['decode_bandwidth_pct']:.0f}%", f"{r['prefill_gflops']:.0f}", f"{r['prefill_mm_pct']:.0f}%",
                      f"{r['prefill_interleaved_ms']:.0f}", f"{r['decode_step_interleaved_ms']:.2f}")
    console.print(table)
    comparison = Table(title=f"against {report['models'][0]['weights_format']} (the median of the ratios of decode "
                             "steps and of prefills that the checkpoints ran in turn, and the range of the "
                             "repetitions' medians; bound: decode-step bytes)",
                       title_justify="left")
    for name in ("batch", "in", "out", "weights", "decode speedup", "range", "bound", "% of bound",
                 "prefill speedup", "range"):
        comparison.add_column(name, justify="right", no_wrap=True)
    span = lambda lo_hi: f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}x"  # noqa: E731
    for c in report["comparison"]:
        comparison.add_row(str(c["batch"]), str(c["input_len"]), str(c["output_len"]), c["weights_format"],
                           f"{c['decode_speedup']:.2f}x", span(c["decode_speedup_range"]), f"{c['decode_bound']:.2f}x",
                           f"{100 * c['decode_speedup'] / c['decode_bound']:.0f}%", f"{c['prefill_speedup']:.2f}x",
                           span(c["prefill_speedup_range"]))
    console.print(comparison)


def batch_scaling(results: Sequence[ModelResult], weights: WeightBytes, *, count_compute: bool = True) -> list[dict]:
    """Decode tokens/s at batch B over batch 1 (same backend, input and output lengths), beside the most a weight
    stream allows: B x bytes(step of 1) / bytes(step of B), the batch-B step reading the distinct experts its
    tokens chose (measured; and, for reference, uniform routing's expectation): it reads more experts, so it
    cannot gain B-fold. And beside the most that the bytes and the GEMMs' FLOPs allow together
    (WeightBytes.decode_step_floor_s, at the batch-B case's measured bandwidth and GEMM rate): at 16 rows a
    projection may take longer to compute than to read. count_compute: False where the probe's GEMM rate is not
    the weights' (int8 dot products do twice a bf16 GEMM's work), leaving that bound at the bytes'."""
    single = {(r.backend, r.input_len, r.output_len): r for r in results if r.batch == 1}
    rows = []
    for r in results:
        base = single.get((r.backend, r.input_len, r.output_len))
        if r.batch == 1 or base is None:
            continue
        context = r.input_len + r.output_len / 2
        single_bytes = weights.decode_step_bytes(1, context, base.decode_experts_per_layer)
        bound = r.batch * single_bytes / weights.decode_step_bytes(r.batch, context, r.decode_experts_per_layer)
        uniform = r.batch * weights.decode_step_bytes(1, context) / weights.decode_step_bytes(r.batch, context)
        speedup = r.decode_tok_s / base.decode_tok_s
        rate = r.mm_gflops if count_compute else None
        floor_1 = weights.decode_step_floor_s(1, context, base.decode_experts_per_layer, r.bandwidth_gbs, rate)
        floor = r.batch * floor_1 / weights.decode_step_floor_s(r.batch, context, r.decode_experts_per_layer,
                                                                r.bandwidth_gbs, rate)
        rows.append(dict(backend=r.backend, batch=r.batch, input_len=r.input_len, output_len=r.output_len,
                         experts_per_layer=r.decode_experts_per_layer, decode_speedup=speedup,
                         bandwidth_bound_speedup=bound, uniform_routing_bound=uniform,
                         pct_of_bound=100 * speedup / bound, bytes_and_gemms_bound_speedup=floor,
                         pct_of_bytes_and_gemms_bound=100 * speedup / floor))
    return rows


def probe_span(result: dict) -> str:
    """The read probes before and after a case ("% bw" is of their mean), or the one probe of an older report."""
    before, after = result.get("bandwidth_before_gbs", float("nan")), result.get("bandwidth_after_gbs", float("nan"))
    if before != before or after != after:  # NaN: not measured
        return f"{result['bandwidth_gbs']:.1f}"
    return f"{before:.1f} / {after:.1f}"


def render_model_report(report: dict, console: Console) -> None:
    w = report["weights"]
    console.print(f"[bold]{report['model']}[/]  {report['dtype']}  weights [bold]{report.get('weights_format', '?')}[/]  "
                  f"experts backend [bold]{report['experts_backend']}[/]  "
                  f"CPU {report['cpu']}  threads {report['threads']}")
    loads = report.get("load_peak_rss_gb_by_engine") or {"fused": report["load_peak_rss_gb"]}
    peaks = ", ".join(f"{name} {gb:.2f} GB" for name, gb in loads.items())
    console.print(f"dense weights {w['dense'] / 1e9:.2f} GB, {w['moe_layers']} MoE layers x {w['experts']} experts "
                  f"x {w['expert'] / 1e6:.1f} MB (top-{w['top_k']}); peak RSS while loading (one engine at a "
                  f"time): {peaks}; KV cache {report['kv_cache_gb']:.2f} GB")
    table = Table(title="model benchmark (ITL and throughput as MoE-Inference-Bench defines them; % bw: of the mean of "
                        "the read probes before and after the case)",
                  title_justify="left")
    for name in ("batch", "in", "out", "experts", "TTFT ms", "ITL ms", "tok/s", "decode tok/s", "decode GB/s",
                 "% bw", "probe GB/s", "prefill GFLOP/s", "% mm", "peak RSS GB"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in report["results"]:
        table.add_row(str(r["batch"]), str(r["input_len"]), str(r["output_len"]), r["backend"],
                      f"{r['ttft_ms']:.1f}", f"{r['itl_ms']:.2f}", f"{r['throughput_tok_s']:.1f}",
                      f"{r['decode_tok_s']:.1f}", f"{r['decode_gbs']:.1f}", f"{r['decode_bandwidth_pct']:.0f}%",
                      probe_span(r), f"{r['prefill_gflops']:.0f}", f"{r['prefill_mm_pct']:.0f}%",
                      f"{r['peak_rss_gb']:.2f}")
    console.print(table)
    ckpt, kv = report["checkpoint_gb"], report["kv_cache_gb"]
    serving = max(r["peak_rss_gb"] for r in report["results"])
    console.print(f"memory: checkpoint {ckpt:.2f} GB; peak RSS loading {report['load_peak_rss_gb']:.2f} GB "
                  f"({report['load_peak_rss_gb'] / ckpt:.2f}x checkpoint); serving {serving:.2f} GB "
                  f"({(serving - kv) / ckpt:.2f}x checkpoint + KV cache {kv:.2f} GB)")
    if report.get("batch_scaling"):
        scaling = Table(title="decode batch scaling (against batch 1; bound: the weight bytes a step reads; "
                              "bytes + GEMMs: each GEMM at the longer of its bytes at the read probe and its FLOPs at "
                              "the mm probe)", title_justify="left")
        for name in ("batch", "in", "out", "experts", "experts/layer", "decode speedup", "bandwidth bound",
                     "% of bound", "bound (uniform routing)", "bytes + GEMMs bound", "% of it"):
            scaling.add_column(name, justify="right", no_wrap=True)
        for s in report["batch_scaling"]:
            floor = s.get("bytes_and_gemms_bound_speedup")   # absent from reports written before it was
            scaling.add_row(str(s["batch"]), str(s["input_len"]), str(s["output_len"]), s["backend"],
                            f"{s['experts_per_layer']:.1f}", f"{s['decode_speedup']:.2f}x",
                            f"{s['bandwidth_bound_speedup']:.2f}x", f"{s['pct_of_bound']:.0f}%",
                            f"{s['uniform_routing_bound']:.2f}x", "" if floor is None else f"{floor:.2f}x",
                            "" if floor is None else f"{s['pct_of_bytes_and_gemms_bound']:.0f}%")
        console.print(scaling)
