"""OLMoE (allenai/OLMoE-1B-7B-0924): q/k RMSNorm over the whole projections (weights [heads * d], [kv_heads * d])
before the split into heads, then q/k/v clamped to [-clip_qkv, clip_qkv] when clip_qkv is set; attention_bias on
all four projections; every layer sparse, experts of intermediate_size, norm_topk_prob false by default.
Config: https://huggingface.co/docs/transformers/model_doc/olmoe
"""
from __future__ import annotations

from cpumoe.models.architecture import ModelPreset
from cpumoe.models.blocks import QKNorm
from cpumoe.models.moe_decoder import MoeDecoderArchitecture


class OlmoeArchitecture(MoeDecoderArchitecture):
    model_type = "olmoe"
    hf_name = "Olmoe"
    qk_norm = QKNorm.FULL
    presets = (
        ModelPreset("olmoe-1b-7b", "allenai/OLMoE-1B-7B-0924", dict(
            num_hidden_layers=16, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, vocab_size=50304,
            intermediate_size=1024, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
            max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
            clip_qkv=None)),
    )
    tiny = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                intermediate_size=32, num_experts=4, num_experts_per_tok=2)


ARCHITECTURE = OlmoeArchitecture()
