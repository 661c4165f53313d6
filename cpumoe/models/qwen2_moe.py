"""Qwen2-MoE (Qwen/Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biased (qkv_bias, true unless config.json says
otherwise; o_proj never), no q/k norm, and a shared expert mlp.shared_expert.{gate,up,down}_proj of
shared_expert_intermediate_size on every token, gated by sigmoid(mlp.shared_expert_gate(x)) and added to the
routed output. norm_topk_prob false by default; dense layers per mlp_only_layers / decoder_sparse_step.
Config: https://huggingface.co/docs/transformers/model_doc/qwen2_moe
"""
from __future__ import annotations

from cpumoe.models.moe_decoder import ArchSpec, MoeDecoderForCausalLM


class Qwen2MoeForCausalLM(MoeDecoderForCausalLM):
    spec = ArchSpec(bias_field="qkv_bias", bias_default=True, o_bias=False,
                    expert_inter_field="moe_intermediate_size", shared_expert=True)
