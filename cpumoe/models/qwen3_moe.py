"""Qwen3-MoE (Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B, ...): per-head q/k RMSNorm, experts of moe_intermediate_size,
dense layers per mlp_only_layers / decoder_sparse_step, norm_topk_prob from config.
Config: https://huggingface.co/docs/transformers/model_doc/qwen3_moe
"""
from __future__ import annotations

from cpumoe.models.blocks import QKNorm
from cpumoe.models.moe_decoder import ArchSpec, MoeDecoderForCausalLM


class Qwen3MoeForCausalLM(MoeDecoderForCausalLM):
    spec = ArchSpec(qk_norm=QKNorm.HEAD, expert_inter_field="moe_intermediate_size")
