"""Qwen3-MoE (Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B, ...): per-head q/k RMSNorm, experts of moe_intermediate_size,
dense layers per mlp_only_layers / decoder_sparse_step, norm_topk_prob from config.
Config: https://huggingface.co/docs/transformers/model_doc/qwen3_moe
"""
from __future__ import annotations

from cpumoe.models.architecture import ModelPreset
from cpumoe.models.blocks import QKNorm
from cpumoe.models.moe_decoder import MoeDecoderArchitecture


class Qwen3MoeArchitecture(MoeDecoderArchitecture):
    model_type = "qwen3_moe"
    hf_name = "Qwen3Moe"
    qk_norm = QKNorm.HEAD
    expert_inter_field = "moe_intermediate_size"
    presets = (
        ModelPreset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", dict(
            num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            vocab_size=151936, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1e6,
            rms_norm_eps=1e-6, tie_word_embeddings=False, max_window_layers=48, use_sliding_window=False)),
        ModelPreset("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", dict(
            num_hidden_layers=94, hidden_size=4096, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
            vocab_size=151936, intermediate_size=12288, moe_intermediate_size=1536, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1e6,
            rms_norm_eps=1e-6, tie_word_embeddings=False, max_window_layers=94, use_sliding_window=False)),
    )
    tiny = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


ARCHITECTURE = Qwen3MoeArchitecture()
