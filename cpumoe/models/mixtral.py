"""Mixtral (mistralai/Mixtral-8x7B-v0.1, 8x22B): no q/k norm, no biases, every layer sparse; the MoE module is
block_sparse_moe, experts block_sparse_moe.experts.{e}.w1 / w3 / w2 (gate / up / down) of intermediate_size.
Routing: top-k of the router logits, softmax over those k == softmax, top-k, renormalize (always).
Sliding-window attention (Mistral-7B style, `sliding_window` set) is refused at load; Mixtral-8x7B has none.
Config: https://huggingface.co/docs/transformers/model_doc/mixtral
"""
from __future__ import annotations

from cpumoe.models.architecture import ModelPreset
from cpumoe.models.moe_decoder import MoeDecoderArchitecture


class MixtralArchitecture(MoeDecoderArchitecture):
    model_type = "mixtral"
    hf_name = "Mixtral"
    bias_field = None
    moe = "block_sparse_moe"
    expert_projections = ("w1", "w3", "w2")
    experts_field = "num_local_experts"
    norm_topk_prob = True
    presets = (
        ModelPreset("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", dict(
            num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
            intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
            rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None)),
        ModelPreset("mixtral-8x22b", "mistralai/Mixtral-8x22B-v0.1", dict(
            num_hidden_layers=56, hidden_size=6144, num_attention_heads=48, num_key_value_heads=8, vocab_size=32000,
            intermediate_size=16384, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=65536,
            rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None)),
    )
    tiny = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)


ARCHITECTURE = MixtralArchitecture()
