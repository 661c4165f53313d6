"""A realistic study in a temporary results database, written once per session, and the report drawn from it.

Layer rows: the paper's sweeps around the Mixtral-8x7B skeleton (H=4096 I=14336 E=8 k=2), one parameter varied at a
time, tokens 1, 16, 32, 64, fused and naive, E=64 out of memory, the skeleton run three times, one skeleton case from a
second machine (without pct_* metrics: the report derives them) and one failed case off the axes.
Model rows: batch 1..64 (fused and naive, each twice), input and output length 128..2048 at batch 1. Serve rows: two
servers over request rates, one case run twice. Experts rows: two prompt sets. Prune rows: none, inter and intra at
three ratios. And one row of a bench the report has no figure for.
"""
from __future__ import annotations

import random

import pytest

from cpumoe.bench.results import ResultsDB

SKELETON = dict(hidden=4096, inter=14336, experts=8, top_k=2)
TOKENS = (1, 16, 32, 64)
OTHER_MACHINE = {"cpu": "Other CPU 9000", "features": ["avx2", "fma"], "cores": 8, "memory_gb": 32}
BANDWIDTH, GEMM = 40.0, 900.0   # the study's machine: GB/s, GFLOP/s

STUDY_ROWS = 158   # rows fill_study writes
# Rows each table of the page must hold for this study.
EXPECTED_ROWS = {
    "machines": 2,
    "layer-tokens-1": 8 + 4 + 1,
    "layer-inter": 4 * 8 + 4 + 1, "layer-experts": 4 * 8 + 4 + 1, "layer-top_k": 4 * 8 + 4 + 1,
    "layer-hidden": 2 * 8 + 4 + 1, "layer-speedup": (11 - 1) * 4 + 4, "layer-all": 11 * 8 + 4 + 1 + 1,
    "model-batch": 8, "model-input_len": 6, "model-output_len": 6, "model-all": 16,
    "serve-request_rate": 8, "serve-max_concurrency": 4, "serve-all": 11,
    "experts-1": 4, "experts-2": 4, "experts-distinct": 8, "prune-all": 7, "activation-all": 2,
}
EXPECTED_FIGURES = {"layer-tokens-1", "layer-inter", "layer-experts", "layer-top_k", "layer-hidden", "layer-speedup",
                    "model-batch", "model-input_len", "model-output_len", "serve-request_rate",
                    "serve-max_concurrency", "experts-1", "experts-2", "experts-distinct", "prune-tradeoff"}


def layer_shapes() -> list[dict]:
    shapes = [dict(SKELETON, inter=i) for i in (1792, 3584, 7168, 14336)]
    shapes += [dict(SKELETON, experts=e) for e in (16, 32, 64)]
    shapes += [dict(SKELETON, top_k=k) for k in (1, 4, 8)]
    shapes += [dict(SKELETON, hidden=2048)]
    return shapes


def layer_metrics(shape: dict, tokens: int, impl: str, jitter: float, pct: bool = True) -> dict:
    h, i, e, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    flops = 2 * tokens * k * 3 * h * i
    expert_bytes = min(e, tokens * k) * 3 * h * i * 2
    seconds = max(expert_bytes / (BANDWIDTH * 0.6e9), flops / (GEMM * 0.5e9)) * (3.0 if impl == "naive" else 1.0)
    seconds *= jitter
    metrics = dict(time_ms=seconds * 1e3, time_ms_min=seconds * 1e3 * 0.97, time_ms_max=seconds * 1e3 * 1.05,
                   gflops=flops / seconds / 1e9, gbs=expert_bytes / seconds / 1e9, flops=flops,
                   expert_bytes=expert_bytes)
    if pct:
        metrics.update(pct_bandwidth=100 * metrics["gbs"] / BANDWIDTH, pct_peak=100 * metrics["gflops"] / GEMM)
    return metrics


def layer_case(shape: dict, tokens: int, impl: str, fmt: str = "bf16", backend: str = "x86-avx512bf16") -> dict:
    return dict(preset="mixtral-8x7b", **shape, format=fmt, backend=backend if impl == "fused" else "naive",
                impl=impl, tokens=tokens, threads=2)


def fill_study(db: ResultsDB) -> None:
    rng = random.Random(0)

    def limits() -> dict:   # what each run measured of the machine
        return dict(bandwidth_gbs=BANDWIDTH * rng.uniform(0.95, 1.0), mm_gflops=GEMM * rng.uniform(0.9, 1.0))

    for shape in layer_shapes():
        for tokens in TOKENS:
            for impl in ("fused", "naive"):
                case = layer_case(shape, tokens, impl)
                if shape["experts"] == 64:
                    db.add("layer", case, {"bytes_needed": 22.5 * 2**30, "bytes_available": 20 * 2**30},
                           status="oom")
                    continue
                for _ in range(3 if shape == SKELETON else 1):
                    db.add("layer", case, layer_metrics(shape, tokens, impl, rng.uniform(0.9, 1.1)), **limits())
    for tokens in TOKENS:   # a second fused backend at the skeleton
        db.add("layer", layer_case(SKELETON, tokens, "fused", backend="x86-avx512"),
               layer_metrics(SKELETON, tokens, "fused", 1.3), **limits())
    for _ in range(2):
        db.add("layer", layer_case(SKELETON, 1, "fused"), layer_metrics(SKELETON, 1, "fused", rng.uniform(1, 2), False),
               bandwidth_gbs=20.0, mm_gflops=300.0, machine_facts=OTHER_MACHINE)
    db.add("layer", dict(layer_case(dict(hidden=2048, inter=768, experts=128, top_k=8), 1, "fused"),
                         preset="qwen3-30b-a3b", format="int8"), {"message": "no backend takes int8 here"},
           status="error")

    model = dict(model="qwen3-4l", format="bf16", threads=2, layers=4, hidden=2048, inter=768, experts=128, top_k=8)
    points = [(b, 128, 128, impl) for b in TOKENS for impl in ("fused", "naive")]
    points += [(1, n, 128, "fused") for n in (256, 512, 1024, 2048)]
    points += [(1, 128, n, "fused") for n in (256, 512, 1024, 2048)]
    for batch, in_len, out_len, impl in points:
        for _ in range(2 if in_len == out_len == 128 else 1):
            slow = (2.5 if impl == "naive" else 1.0) * rng.uniform(0.95, 1.05)
            ttft = 40.0 * in_len / 128 * batch ** 0.5 * slow
            itl = 20.0 * (1 + batch / 32) * slow
            e2e = (ttft + itl * batch * (out_len - 1)) / 1e3
            db.add("model", dict(model, batch=batch, input_len=in_len, output_len=out_len, impl=impl),
                   dict(ttft_ms=ttft, itl_ms=itl, e2e_s=e2e, throughput_tok_s=batch * (in_len + out_len) / e2e,
                        decode_tok_s=batch * 1e3 / itl, prefill_tok_s=batch * in_len * 1e3 / ttft,
                        decode_pct_bandwidth=60.0 / slow, prefill_pct_peak=30.0 / slow, peak_rss_gb=5.5), **limits())

    serve_points = [("cpumoe", rate, None) for rate in (1, 2, 4, 8, "inf")]
    serve_points += [("vllm-cpu", rate, None) for rate in (1, 4, "inf")]
    serve_points += [("cpumoe", "inf", concurrency) for concurrency in (1, 4, 16)]
    for label, rate, concurrency in serve_points:
        load = 1 + ((concurrency or 16) if rate == "inf" else rate) / 4
        for _ in range(2 if (label, rate) == ("cpumoe", 4) else 1):
            metrics = dict(completed=64, failed=0, duration=64 / min(load, 3), request_throughput=min(load, 3),
                           output_throughput=128 * min(load, 3), total_token_throughput=640 * min(load, 3),
                           request_goodput=min(load, 3) * 0.9)
            for what, base in (("ttft", 300.0), ("tpot", 40.0), ("itl", 38.0), ("e2el", 5000.0)):
                value = base * load * rng.uniform(0.95, 1.05)
                metrics.update({f"mean_{what}_ms": value, f"median_{what}_ms": value,
                                f"p90_{what}_ms": value * 1.5, f"p99_{what}_ms": value * 2.2})
            db.add("serve", dict(label=label, base_url="http://127.0.0.1:8000", model="qwen3-4l",
                                 endpoint="/v1/completions", dataset="random", input_len=512, output_len=128,
                                 num_prompts=64, request_rate=rate, burstiness=1.0, max_concurrency=concurrency,
                                 seed=0),
                   metrics)

    for prompts in ("random", "sharegpt.jsonl"):
        counts = [[rng.randint(0, 400) for _ in range(128)] for _ in range(4)]   # [L, E]
        db.add("experts", dict(model="qwen3-4l", prompts=prompts, tokens=4096),
               dict(counts=counts, layers=[1, 2, 3, 4], experts=128, top_k=8, max_over_mean=[3.1, 2.5, 2.2, 2.9],
                    cv=[0.8, 0.6, 0.5, 0.7], entropy=[6.5, 6.7, 6.8, 6.6], entropy_norm=[0.93, 0.96, 0.97, 0.94],
                    never_chosen=[3, 1, 0, 2], distinct_batches=[1, 16, 32, 64],
                    distinct_measured=[8, 60, 85, 105], distinct_uniform=[8, 82, 113, 126]))

    for method, ratio in (("none", 0.0), *((m, r) for m in ("inter", "intra") for r in (0.125, 0.25, 0.5))):
        db.add("prune", dict(model="qwen3-4l", method=method, ratio=ratio),
               dict(perplexity=8.0 * (1 + (2 if method == "inter" else 3) * ratio ** 1.5),
                    top1_agreement=1 - (0.6 if method == "inter" else 0.8) * ratio,
                    kl_divergence=0.5 * ratio, decode_tok_s=10 / (1 - ratio / 2), prefill_tok_s=300 / (1 - ratio / 3),
                    speedup_decode=1 / (1 - ratio / 2), speedup_prefill=1 / (1 - ratio / 3),
                    expert_params=int(1e9 * (1 - ratio))))

    for width in (1, 2):
        db.add("activation", dict(kind="silu", width=width), dict(time_ms=0.5 * width, note="text is not tabled"))


@pytest.fixture(scope="session")
def study_db(tmp_path_factory):
    path = tmp_path_factory.mktemp("study") / "results.db"
    with ResultsDB(path) as db:
        fill_study(db)
    return path


@pytest.fixture(scope="session")
def study_report(study_db, tmp_path_factory):
    """The report of the study, written once: (output directory, Written)."""
    from cpumoe.report.write import write_report

    out = tmp_path_factory.mktemp("report")
    return out, write_report(study_db, out)
