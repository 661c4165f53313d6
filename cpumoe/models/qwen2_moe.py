"""Qwen2-MoE (Qwen/Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biased (qkv_bias, true unless config.json says
otherwise; o_proj never), no q/k norm, and a shared expert mlp.shared_expert.{gate,up,down}_proj of
shared_expert_intermediate_size on every token, gated by sigmoid(mlp.shared_expert_gate(x)) and added to the
routed output. norm_topk_prob false by default; dense layers per mlp_only_layers / decoder_sparse_step.
Config: https://huggingface.co/docs/transformers/model_doc/qwen2_moe
"""
from __future__ import annotations

from cpumoe.models.architecture import ModelPreset
from cpumoe.models.moe_decoder import MoeDecoderArchitecture


class Qwen2MoeArchitecture(MoeDecoderArchitecture):
    model_type = "qwen2_moe"
    hf_name = "Qwen2Moe"
    bias_field, bias_default, o_bias = "qkv_bias", True, False
    expert_inter_field = "moe_intermediate_size"
    shared_expert = True
    presets = (
        ModelPreset("qwen1.5-moe-a2.7b", "Qwen/Qwen1.5-MoE-A2.7B", dict(
            num_hidden_layers=24, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
            intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
            num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1, max_position_embeddings=8192,
            rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False)),
        ModelPreset("qwen2-57b-a14b", "Qwen/Qwen2-57B-A14B", dict(
            num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, vocab_size=151936,
            intermediate_size=18944, moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
            num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, decoder_sparse_step=1,
            max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
            use_sliding_window=False)),
    )
    tiny = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                shared_expert_intermediate_size=48, mlp_only_layers=[1])


ARCHITECTURE = Qwen2MoeArchitecture()
