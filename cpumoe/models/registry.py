"""Every architecture cpumoe runs, by config.json's model_type: one line each."""
from __future__ import annotations

from cpumoe.models import (deepseek_v2, deepseek_v3, gemma4, glm4_moe, gpt_oss, llama4, mixtral, olmoe, phimoe,
                           qwen2_moe, qwen3_moe)
from cpumoe.models.architecture import Architecture, ModelPreset

# in the order `cpumoe make-model --help` and the layer presets list them (the default checkpoint's first)
ARCHITECTURES: dict[str, Architecture] = {arch.model_type: arch for arch in (
    qwen3_moe.ARCHITECTURE,
    olmoe.ARCHITECTURE,
    qwen2_moe.ARCHITECTURE,
    deepseek_v2.ARCHITECTURE,
    deepseek_v3.ARCHITECTURE,
    mixtral.ARCHITECTURE,
    gpt_oss.ARCHITECTURE,
    llama4.ARCHITECTURE,
    glm4_moe.ARCHITECTURE,
    phimoe.ARCHITECTURE,
    gemma4.ARCHITECTURE,
)}


def architecture(model_type: str) -> Architecture:
    for arch in ARCHITECTURES.values():
        if model_type in arch.also_reads:  # a multimodal checkpoint of a language model cpumoe runs
            return arch
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[model_type]


def model_presets() -> dict[str, tuple[Architecture, ModelPreset]]:
    """Every real model of every architecture, by preset name."""
    return {preset.name: (arch, preset) for arch in ARCHITECTURES.values() for preset in arch.presets}
