"""RoPE variants: the inverse frequencies and the attention factor of a config's rope dict, op for op as
transformers 5.24 computes them (`modeling_rope_utils.py`: ROPE_INIT_FUNCTIONS, and the models' own
compute_default_rope_parameters for "default"), so cos/sin agree bit for bit in float32.

    config.json --rope_from_config--> theta, scaling (a normalized copy of rope_parameters / rope_scaling, or None)
    rope_parameters(head_dim, theta, scaling) -> inv_freq [head_dim // 2] float32, attention_factor
    cos, sin = cos(p * inv_freq) * attention_factor, sin(p * inv_freq) * attention_factor

Supported types (SUPPORTED):
    default  inv_freq[i] = theta^(-2i/d)
    linear   default / factor (position interpolation)
    yarn     per-frequency blend of default and default / factor, ramped between the dimensions that turn beta_fast
             and beta_slow times over original_max_position_embeddings (https://arxiv.org/abs/2309.00071);
             attention_factor from factor, mscale, mscale_all_dim unless given
    llama3   low frequencies / factor, high ones kept, a smooth blend between (Llama 3.1)
Not supported: "dynamic" (transformers recomputes inv_freq from the longest position of each forward call, past
max_position_embeddings, a state that keys already rotated in a paged cache cannot follow), "longrope",
"proportional", partial rotary, and rope dicts nested per layer type.
"""
from __future__ import annotations

import math

import torch

SUPPORTED = ("default", "linear", "yarn", "llama3")
# rope types whose dict needs original_max_position_embeddings (transformers fills it from the config)
_NEEDS_ORIGINAL_MAX = ("yarn", "llama3")


def rope_type(scaling: dict | None) -> str:
    """The dict's "rope_type" (or legacy "type"); "default" for None or an empty dict."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type")) or "default"


def rope_from_config(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from a config.json dict, as transformers' standardize_rope_params reads it: the dict is
    rope_scaling or else rope_parameters; theta is the dict's rope_theta, else the config's, else 10000; for yarn and
    llama3, original_max_position_embeddings comes from the config's top level when it has one (Phi-3's exception),
    else from the dict, else from max_position_embeddings. scaling is None for default RoPE. Raises ValueError for a
    type rope_parameters does not support."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"rope parameters nested per layer type ({sorted(rope)}) are not supported")
    theta = float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)
    kind = rope_type(rope)
    if kind not in SUPPORTED:
        raise ValueError(_unsupported(kind))
    if kind == "default":
        return theta, None
    scaling = {k: v for k, v in rope.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = kind
    if kind in _NEEDS_ORIGINAL_MAX:
        if config.get("original_max_position_embeddings") is not None:
            scaling["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        elif scaling.get("original_max_position_embeddings") is None:
            scaling["original_max_position_embeddings"] = config.get("max_position_embeddings")
    if kind == "yarn" and scaling.get("factor") is None and config.get("max_position_embeddings"):
        # DeepSeek-V3 style: no factor, the ratio of the context lengths instead
        scaling["factor"] = config["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    return theta, scaling


def rope_parameters(head_dim: int, theta: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim // 2] float32 on the CPU and the attention factor (cos/sin multiplier) for RoPE over
    head_dim channels with base theta, scaled as `scaling` says (None: default RoPE)."""
    kind = rope_type(scaling)
    if kind not in SUPPORTED:
        raise ValueError(_unsupported(kind))
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    channels = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()  # [d/2]
    if kind == "default":
        return 1.0 / (theta ** (channels / head_dim)), 1.0
    factor = _require(scaling, "factor")
    if kind == "linear":
        return 1.0 / (theta ** (channels / head_dim)) / factor, 1.0
    if kind == "llama3":
        return _llama3(head_dim, theta, scaling, channels), 1.0
    return _yarn(head_dim, theta, scaling, channels)


def _yarn(dim: int, base: float, scaling: dict, channels: torch.Tensor) -> tuple[torch.Tensor, float]:
    """transformers' _compute_yarn_parameters."""
    factor = _require(scaling, "factor")
    original_max = _require(scaling, "original_max_position_embeddings")
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:  # the dimension that turns num_rotations times
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)  # [d/2]
    pos_freqs = base ** (channels / dim)  # [d/2]
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp  # 1: keep the frequency (fast dims), 0: interpolate it (slow dims)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _llama3(dim: int, base: float, scaling: dict, channels: torch.Tensor) -> torch.Tensor:
    """transformers' _compute_llama3_parameters."""
    inv_freq = 1.0 / (base ** (channels / dim))  # [d/2]
    factor = _require(scaling, "factor")
    low_freq_factor, high_freq_factor = _require(scaling, "low_freq_factor"), _require(scaling, "high_freq_factor")
    old_context_len = _require(scaling, "original_max_position_embeddings")
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _require(scaling: dict, key: str):
    if scaling.get(key) is None:
        raise ValueError(f"rope type {rope_type(scaling)!r} needs {key!r} in its parameters, got {scaling}")
    return scaling[key]


def _unsupported(kind: str) -> str:
    return f"rope type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}"
