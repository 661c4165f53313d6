"""DeepSeek-V3 (model_type "deepseek_v3": DeepSeek-V3, -V3.1, -R1, Moonlight), as transformers' DeepseekV3ForCausalLM.

DeepSeek-V2's model (deepseek_v2.py: MLA attention with the latent KV cache, dense first layers, shared experts, yarn
RoPE), of which it reuses every class, with another router ("noaux_tc"), the router of cpumoe.select_experts:

    router logits [M, E] = x (float32) @ gate.weight (float32).T -> scores = sigmoid(logits)
    choice = scores + gate.e_score_correction_bias [E]       (for the choice only)
    the topk_group of n_group groups with the largest sum of their best two choice scores stay selectable
    top-k of the choice -> weights = the chosen experts' scores, / their sum when norm_topk_prob,
                           * routed_scaling_factor

Other departures from DeepSeek-V2, as transformers' DeepseekV3 does them:
- the router's weight and correction bias stay float32 whatever the model dtype (fp32_parameters; transformers'
  _keep_in_fp32_modules_strict), and the router is not an nn.Linear, so pack_linears leaves it alone;
- rope_interleave (default True) rotates the rope channels' pairs (x[2i], x[2i+1]) as V2 does; False rotates the
  halves' pairs (x[i], x[i + r/2]) (mla.py);
- config.json defaults are DeepseekV3Config's (norm_topk_prob True, n_group 8, topk_group 4, ...).
The attention (q_lora or plain q_proj, softmax scale x yarn mscale(factor, mscale_all_dim)^2), first_k_dense_replace
and the ungated shared MLP of moe_intermediate_size * n_shared_experts are V2's. The multi-token-prediction layer
(model.layers.{num_hidden_layers}, num_nextn_predict_layers) is not read, as transformers does not. Refused with a
CheckpointError: topk_method other than "noaux_tc", scoring_func other than "sigmoid", and quantized checkpoints
(the published DeepSeek-V3 / R1 ones are FP8 with block scales: convert them to BF16 first).
Config: https://huggingface.co/docs/transformers/model_doc/deepseek_v3
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cpumoe.layer import FusedMoE
from cpumoe.loader import CheckpointConfig, CheckpointError
from cpumoe.models.architecture import ModelPreset
from cpumoe.models.blocks import MoEBlock
from cpumoe.models.deepseek_v2 import (DEFAULTS, DeepseekV2Architecture, DeepseekV2Config, DeepseekV2MoE,
                                       DeepseekV2TopkRouter, config_fields)

TOPK_METHODS = ("noaux_tc",)
# transformers' DeepseekV3Config defaults, where config.json leaves a field out
V3_DEFAULTS = {**DEFAULTS, "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3,
               "q_lora_rank": 1536, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
               "routed_scaling_factor": 2.5}


@dataclass(slots=True)
class DeepseekV3Config(DeepseekV2Config):
    norm_topk_prob: bool = True

    def moe_block(self, backend: str) -> MoEBlock:
        return DeepseekV3MoE(
            hidden_size=self.hidden_size, num_experts=self.n_routed_experts, inter_size=self.moe_intermediate_size,
            top_k=self.num_experts_per_tok, shared_inter_size=self.moe_intermediate_size * self.n_shared_experts,
            num_expert_group=self.n_group, topk_group=self.topk_group, renormalize=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor, backend=backend)

    @classmethod
    def from_checkpoint(cls, ckpt: CheckpointConfig) -> "DeepseekV3Config":
        get = ckpt.config_get
        if (scoring := get("scoring_func", default="sigmoid")) != "sigmoid":
            raise CheckpointError(f"{ckpt.path}: scoring_func {scoring!r} is not supported (DeepSeek-V3: sigmoid)")
        return cls(**config_fields(ckpt, TOPK_METHODS, V3_DEFAULTS),
                   norm_topk_prob=bool(get("norm_topk_prob", default=True)),
                   rope_interleave=bool(get("rope_interleave", default=True)))


class DeepseekV3TopkRouter(DeepseekV2TopkRouter):
    """V2's router plus the correction bias (mlp.gate.e_score_correction_bias [E], float32)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__(hidden_size, num_experts)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))


class DeepseekV3MoE(DeepseekV2MoE):
    """DeepseekV2MoE (float32 router logits, experts, ungated shared MLP) with sigmoid scores, the correction bias
    and always-grouped top-k (n_group 1 keeps every expert selectable: Moonlight, Kimi-K2)."""

    def __init__(self, *, hidden_size: int, num_experts: int, inter_size: int, top_k: int, shared_inter_size: int,
                 num_expert_group: int, topk_group: int, renormalize: bool, routed_scaling_factor: float,
                 backend: str = "auto"):
        super().__init__(hidden_size=hidden_size, num_experts=num_experts, inter_size=inter_size, top_k=top_k,
                         shared_inter_size=shared_inter_size, num_expert_group=num_expert_group,
                         topk_group=topk_group, routed_scaling_factor=routed_scaling_factor, scoring="sigmoid",
                         renormalize=renormalize, backend=backend)
        self.gate = DeepseekV3TopkRouter(hidden_size, num_experts)

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor, expert_reader=None, dtype=None) -> None:  # see MoEBlock
        """As DeepseekV2MoE's, plus the router's correction bias (loaded before the experts)."""
        self.experts = FusedMoE(w13, w2, top_k=self.top_k, renormalize=self.renormalize, backend=self.backend,
                                expert_reader=expert_reader, e_score_correction_bias=self.gate.e_score_correction_bias,
                                dtype=dtype, **self.routing)


class DeepseekV3Architecture(DeepseekV2Architecture):
    """DeepSeek-V2's architecture over a DeepseekV3Config (whose moe_block builds DeepseekV3MoE)."""
    model_type = "deepseek_v3"
    hf_name = "DeepseekV3"
    fp32_parameters = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    presets = (
        ModelPreset("deepseek-v3", "deepseek-ai/DeepSeek-V3", dict(
            num_hidden_layers=61, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
            vocab_size=129280, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
            n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="noaux_tc", n_group=8,
            topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid",
            rms_norm_eps=1e-6, max_position_embeddings=163840, tie_word_embeddings=False, attention_bias=False,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                                 original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                 mscale_all_dim=1.0))),
        ModelPreset("moonlight-16b-a3b", "moonshotai/Moonlight-16B-A3B", dict(
            num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
            vocab_size=163840, intermediate_size=11264, moe_intermediate_size=1408, n_routed_experts=64,
            n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="noaux_tc", n_group=1,
            topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True, scoring_func="sigmoid",
            rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False,
            rope_parameters=dict(rope_type="default", rope_theta=50000.0))),
    )
    tiny = dict(DeepseekV2Architecture.tiny, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                topk_method="noaux_tc", routed_scaling_factor=2.5, norm_topk_prob=True)

    def config(self, ckpt: CheckpointConfig) -> DeepseekV3Config:
        return DeepseekV3Config.from_checkpoint(ckpt)


ARCHITECTURE = DeepseekV3Architecture()
