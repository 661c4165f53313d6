"""Results-database rows of the `layer` and `model` benches: one place that says what a case and its metrics are,
for the sweeps and for `cpumoe bench layer` / `cpumoe bench model` (record_layer_report, record_model_report).

    layer case    {preset, hidden, inter, experts, top_k, format, backend, impl, tokens, threads}
          metrics {time_ms, time_ms_min, time_ms_max, gflops, gbs, pct_bandwidth, pct_peak, flops, expert_bytes,
                   bytes_read, distinct_experts, repetitions, speedup_vs_naive, speedup_vs_bf16}
    model case    {model, format, batch, input_len, output_len, threads, impl, layers, hidden, inter, experts, top_k}
          metrics {ttft_ms, itl_ms, e2e_s, throughput_tok_s, decode_tok_s, prefill_tok_s, decode_pct_bandwidth,
                   prefill_pct_peak, peak_rss_gb, decode_gbs, prefill_gflops, decode_experts_per_layer}

format is "bf16", "fp32", "fp16", "int8", "int4", "fp8" or "mxfp4" (int4 and fp8 with a group other than the
default 128 get "-g<size>"); expert_bytes is one expert's w13 + w2 as the backend holds them, bytes_read the distinct
experts' (what gbs divides). layers is null for a checkpoint run as it is (its own depth) and N for a synthetic
checkpoint of N layers. A value not measured (decode of a 1-token output) is null. Each row carries the read
bandwidth and GEMM rate its percentages are of.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cpumoe.bench.results import ResultsDB

DEFAULT_GROUP = 128   # the layer bench's and `cpumoe quantize`'s default int4 group / fp8 k block
_SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "int8_w8a8": "int8", "int4_w4a16": "int4",
          "fp8_w8a16": "fp8", "mxfp4_w4a16": "mxfp4"}
_GROUPED = ("int4_w4a16", "fp8_w8a16")


def format_label(name: str, group_size: int | None = None) -> str:
    """"bfloat16" -> "bf16", "int4_w4a16" (group 32) -> "int4-g32"; a name already short stays."""
    short = _SHORT.get(name, name)
    if name in _GROUPED and group_size not in (None, 0, DEFAULT_GROUP):
        short += f"-g{group_size}"
    return short


def impl_of(backend: str) -> str:
    return "naive" if backend == "naive" else "fused"


def _finite(value: float | None) -> float | None:
    return None if value is None or (isinstance(value, float) and not math.isfinite(value)) else value


# ---- layer ------------------------------------------------------------------------------------------------------

def layer_case(*, preset: str, hidden: int, inter: int, experts: int, top_k: int, format: str, backend: str,
               tokens: int, threads: int) -> dict[str, Any]:
    return dict(preset=preset, hidden=hidden, inter=inter, experts=experts, top_k=top_k, format=format,
                backend=backend, impl=impl_of(backend), tokens=tokens, threads=threads)


def layer_metrics(result: dict, *, hidden: int, inter: int, top_k: int) -> dict[str, Any]:
    """A LayerResult (as a dict) -> the row's metrics."""
    return dict(time_ms=result["ms"], time_ms_min=result.get("ms_min"), time_ms_max=result.get("ms_max"),
                gflops=result["gflops"], gbs=result["gbs"], pct_bandwidth=result["bandwidth_pct"],
                pct_peak=result["peak_pct"], flops=2 * result["tokens"] * top_k * 3 * hidden * inter,
                expert_bytes=result["expert_bytes"], bytes_read=result["distinct_experts"] * result["expert_bytes"],
                distinct_experts=result["distinct_experts"], repetitions=result["repetitions"],
                speedup_vs_naive=result.get("speedup_vs_naive"), speedup_vs_bf16=result.get("speedup_vs_bf16"))


def record_layer_report(db: ResultsDB, report: dict) -> list[int]:
    """One `layer` row per result of a `run_layer_bench` report; returns the row ids."""
    layer, machine = report["layer"], report["machine"]
    groups = {f["format"]: f["group_size"] for f in layer["formats"]}
    ids = []
    for r in report["results"]:
        case = layer_case(preset=layer["name"], hidden=layer["hidden"], inter=layer["inter"],
                          experts=layer["experts"], top_k=layer["top_k"],
                          format=format_label(r["format"], groups.get(r["format"])), backend=r["backend"],
                          tokens=r["tokens"], threads=machine["threads"])
        metrics = layer_metrics(r, hidden=layer["hidden"], inter=layer["inter"], top_k=layer["top_k"])
        ids.append(db.add("layer", case, metrics, bandwidth_gbs=r["bandwidth_gbs"], mm_gflops=r["mm_gflops"]))
    return ids


# ---- model ------------------------------------------------------------------------------------------------------

def checkpoint_shape(path: str | Path) -> dict[str, int | None]:
    """{hidden, inter, experts, top_k} of a checkpoint's MoE layers, from its config.json."""
    from cpumoe.loader import Checkpoint

    ckpt = Checkpoint(path)
    get = lambda *keys: ckpt.config_get(*keys, default=None)  # noqa: E731
    return dict(hidden=get("hidden_size"),
                inter=get("moe_intermediate_size", "intermediate_size"),
                experts=get("num_experts", "num_local_experts", "n_routed_experts"),
                top_k=get("num_experts_per_tok", "experts_per_token"))


def checkpoint_format(path: str | Path, dtype: str | None = None) -> str:
    """The experts' format of a checkpoint as the engine would load it: its quantized format ("int8", ...), else
    `dtype` if given ("bf16", ...), else the dtype config.json names (fp32 if none: what the loader takes)."""
    from cpumoe.loader import Checkpoint
    from cpumoe.loader.quantized import QuantizedCheckpoint

    ckpt = Checkpoint(path)
    quant = QuantizedCheckpoint(ckpt).format
    if quant is not None:
        return format_label(quant.value)
    if dtype is not None:
        return format_label(dtype)
    torch_dtype = ckpt.torch_dtype
    return format_label(str(torch_dtype).removeprefix("torch.")) if torch_dtype is not None else "fp32"


def model_case(*, model: str, format: str, batch: int, input_len: int, output_len: int, threads: int, impl: str,
               layers: int | None, shape: dict[str, int | None]) -> dict[str, Any]:
    return dict(model=model, format=format, batch=batch, input_len=input_len, output_len=output_len,
                threads=threads, impl=impl, layers=layers, hidden=shape["hidden"], inter=shape["inter"],
                experts=shape["experts"], top_k=shape["top_k"])


def model_metrics(result: dict, weights: dict) -> dict[str, Any]:
    """A ModelResult (as a dict) and the WeightBytes (as a dict) of its model -> the row's metrics. prefill_tok_s
    is prompt tokens over the time to the last first token (the prefill rate's own time)."""
    from cpumoe.bench.model import WeightBytes

    fields = {k: weights[k] for k in WeightBytes.__dataclass_fields__ if k in weights}
    flops = WeightBytes(**fields).prefill_flops(result["batch"], result["input_len"])
    prefill_s = flops / (result["prefill_gflops"] * 1e9) if result["prefill_gflops"] else None
    return dict(ttft_ms=result["ttft_ms"], itl_ms=result["itl_ms"], e2e_s=result["e2e_s"],
                throughput_tok_s=result["throughput_tok_s"], decode_tok_s=_finite(result["decode_tok_s"]),
                prefill_tok_s=None if not prefill_s else result["batch"] * result["input_len"] / prefill_s,
                decode_pct_bandwidth=_finite(result["decode_bandwidth_pct"]),
                prefill_pct_peak=_finite(result["prefill_mm_pct"]), peak_rss_gb=result["peak_rss_gb"],
                decode_gbs=_finite(result["decode_gbs"]), prefill_gflops=_finite(result["prefill_gflops"]),
                decode_experts_per_layer=_finite(result["decode_experts_per_layer"]))


def record_model_report(db: ResultsDB, report: dict, model_name: str | Sequence[str] | None = None,
                        layers: int | None = None) -> list[int]:
    """One `model` row per result of a `run_model_bench` report, or of a `run_formats_bench` one (several
    checkpoints: `model_name` may then name each). model_name defaults to the checkpoint directory's name;
    `layers`: N for a synthetic checkpoint of N layers, None for a checkpoint run as it is. Rows of batch-invariant
    engines (`bench model --batch-invariant`) are not recorded. Returns the row ids."""
    if "models" in report:   # run_formats_bench: results carry the index of their checkpoint
        models = [(m["model"], m["weights"], m["dtype"]) for m in report["models"]]
        # a batch-invariant engine's rows have no case field of their own (they would pass for the plain ones')
        skip = {i for i, m in enumerate(report["models"]) if m["weights_format"].endswith(" invariant")}
    else:
        models, skip = [(report["model"], report["weights"], report["dtype"])], set()
    names = [model_name] * len(models) if model_name is None or isinstance(model_name, str) else list(model_name)
    if len(names) != len(models):
        raise ValueError(f"{len(names)} model names for {len(models)} checkpoints")
    described = [dict(name=name or Path(path).name, shape=checkpoint_shape(path),
                      format=checkpoint_format(path, format_label(dtype)), weights=weights)
                 for (path, weights, dtype), name in zip(models, names)]
    ids = []
    for r in report["results"]:
        index = r.get("model", 0) if "models" in report else 0
        if index in skip:
            continue
        m = described[index]
        case = model_case(model=m["name"], format=m["format"], batch=r["batch"], input_len=r["input_len"],
                          output_len=r["output_len"], threads=report["threads"], impl=impl_of(r["backend"]),
                          layers=layers, shape=m["shape"])
        ids.append(db.add("model", case, model_metrics(r, m["weights"]), bandwidth_gbs=r["bandwidth_gbs"],
                          mm_gflops=r["mm_gflops"]))
    return ids
