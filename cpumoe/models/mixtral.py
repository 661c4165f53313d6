"""Mixtral (mistralai/Mixtral-8x7B-v0.1, 8x22B): no q/k norm, no biases, every layer sparse; the MoE module is
block_sparse_moe, experts block_sparse_moe.experts.{e}.w1 / w3 / w2 (gate / up / down) of intermediate_size.
Routing: top-k of the router logits, softmax over those k == softmax, top-k, renormalize (always).
Sliding-window attention (Mistral-7B style, `sliding_window` set) is refused at load; Mixtral-8x7B has none.
Config: https://huggingface.co/docs/transformers/model_doc/mixtral
"""
from __future__ import annotations

from cpumoe.models.moe_decoder import ArchSpec, MoeDecoderForCausalLM


class MixtralForCausalLM(MoeDecoderForCausalLM):
    spec = ArchSpec(bias_field=None, moe="block_sparse_moe", experts=("w1", "w3", "w2"), norm_topk_prob=True)
