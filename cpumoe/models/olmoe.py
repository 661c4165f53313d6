"""OLMoE (allenai/OLMoE-1B-7B-0924): q/k RMSNorm over the whole projections (weights [heads * d], [kv_heads * d])
before the split into heads, then q/k/v clamped to [-clip_qkv, clip_qkv] when clip_qkv is set; attention_bias on
all four projections; every layer sparse, experts of intermediate_size, norm_topk_prob false by default.
Config: https://huggingface.co/docs/transformers/model_doc/olmoe
"""
from __future__ import annotations

from cpumoe.models.blocks import QKNorm
from cpumoe.models.moe_decoder import ArchSpec, MoeDecoderForCausalLM


class OlmoeForCausalLM(MoeDecoderForCausalLM):
    spec = ArchSpec(qk_norm=QKNorm.FULL)
