"""What cpumoe knows about one architecture, in one place: how its config.json reads, which modules make a layer,
how its experts sit in a checkpoint, and the real models of its family (presets).

    Architecture  the model (layer, embedding, final norm, logits), the loader (fp32 parameters, expert tensors),
                  make-model and the layer benchmarks (presets, layer_preset), the conformance test (tiny)
    DecoderLayer  the pre-norm layer most architectures assemble from their attention, MLP/MoE and norms:
                  x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x))

An architecture is one file of cpumoe/models defining a subclass and an instance, plus one line in registry.py.
Module names follow the checkpoint's tensor names, so every parameter loads from the tensor of its own name and
the synthetic checkpoints of make-model take their names and shapes from the model itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from cpumoe.attention import AttentionContext, KVCacheLayout
from cpumoe.loader import CheckpointConfig
from cpumoe.models.blocks import ExpertWeights, MoEBlock, RMSNorm

if TYPE_CHECKING:
    from cpumoe.loader import Checkpoint
    from cpumoe.presets import LayerPreset


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """A real model of an architecture: its config.json values (all but num_hidden_layers, which make-model sets).
    hub_id says where the values come from."""
    name: str
    hub_id: str
    config: dict


class Architecture:
    """One architecture. Subclasses set the class attributes and define `config` and `layer`; the rest has
    defaults that fit a Llama-style decoder with per-expert gate/up/down tensors."""
    model_type: ClassVar[str]          # config.json's model_type
    hf_name: ClassVar[str]             # transformers' {hf_name}Config / {hf_name}ForCausalLM
    # other config.json model_types whose checkpoints hold this model (open_checkpoint finds it in them)
    also_reads: ClassVar[tuple[str, ...]] = ()
    presets: ClassVar[tuple[ModelPreset, ...]] = ()
    # config.json values that make the first preset a model of a few hundred kB with every feature of the
    # architecture switched on (make-model --tiny, the conformance test)
    tiny: ClassVar[dict] = {}
    # parameters kept in float32 whatever the model dtype (names ending so; routers transformers keeps in float32)
    fp32_parameters: ClassVar[tuple[str, ...]] = ()
    # names of the three projections of one expert (gate, up, down), under "{moe}.experts.{e}."
    expert_projections: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    @property
    def hf_config_class(self) -> str:
        """transformers' config class of the checkpoints make-model writes and the conformance test saves."""
        return f"{self.hf_name}Config"

    @property
    def hf_model_class(self) -> str:
        """transformers' causal LM class of those checkpoints."""
        return f"{self.hf_name}ForCausalLM"

    def open_checkpoint(self, ckpt: Checkpoint) -> Checkpoint:
        """The checkpoint as the model reads it: itself, or the language model inside a multimodal one."""
        return ckpt

    def config(self, ckpt: CheckpointConfig) -> Any:
        """The architecture's config dataclass from config.json; a value cpumoe cannot run is a CheckpointError.
        It has vocab_size, hidden_size, num_hidden_layers and tie_word_embeddings at least."""
        raise NotImplementedError

    def layer(self, config: Any, index: int, backend: str) -> nn.Module:
        """Layer `index`: forward(x, positions, context) -> x."""
        raise NotImplementedError

    def embedding(self, config: Any) -> nn.Module:
        return nn.Embedding(config.vocab_size, config.hidden_size)

    def final_norm(self, config: Any) -> nn.Module:
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def final_logits(self, config: Any, logits: torch.Tensor) -> torch.Tensor:
        """The float32 logits after the lm_head (soft-capping, where an architecture has it)."""
        return logits

    def kv_cache_layout(self, config: Any) -> KVCacheLayout:
        """What a token of a layer keeps in the paged cache (GQA: K and V of num_key_value_heads x head_dim)."""
        return KVCacheLayout(num_kv_heads=config.num_key_value_heads, k_dim=config.head_dim, v_dim=config.head_dim)

    def expert_weights(self, config: Any) -> dict[str, ExpertWeights]:
        """How each MoE block's per-expert tensors stack into FusedMoE's w13 [E, 2I, H] and w2 [E, H, I] (names
        relative to the block), or where transformers' fused form of them is."""
        gate, up, down = self.expert_projections
        return {
            "w13": ExpertWeights(per_expert=(f"experts.{{e}}.{gate}.weight", f"experts.{{e}}.{up}.weight"),
                                 fused="experts.gate_up_proj"),  # [E, 2I, H]
            "w2": ExpertWeights(per_expert=(f"experts.{{e}}.{down}.weight",), fused="experts.down_proj"),  # [E, H, I]
        }

    def experts_from_checkpoint(self, config: Any, ckpt: Checkpoint, prefix: str, block: MoEBlock,
                                dtype: torch.dtype) -> dict | None:
        """The block's load_experts arguments, for experts stored in a way expert_weights cannot say (transposed,
        interleaved, with biases); None: expert_weights says it."""
        return None

    def expert_tensors(self, config: Any, block: MoEBlock) -> list[tuple[str, tuple[int, ...]]]:
        """The block's expert tensors as the hub stores them (names relative to the block, shapes): what a
        synthetic checkpoint writes."""
        E, I, H = block.num_experts, block.inter_size, block.hidden_size
        specs = self.expert_weights(config)
        return [(pattern.format(e=e), shape) for e in range(E)
                for key, shape in (("w13", (I, H)), ("w2", (H, I))) for pattern in specs[key].per_expert]

    def layer_preset(self, preset: ModelPreset) -> LayerPreset:
        """The MoE layer of a preset, as the layer benchmarks run it."""
        raise NotImplementedError

    def layer_shape_config(self, *, hidden: int, inter: int, experts: int, top_k: int) -> dict:
        """config.json values that give the MoE layers this shape (the architecture sweeps)."""
        raise NotImplementedError(f"{self.model_type}: no MoE layer shape config")

    def preset_config(self, preset: ModelPreset) -> Any:
        """The config dataclass of a preset (its values as config.json would hold them)."""
        return self.config(CheckpointConfig(preset.name, {"model_type": self.model_type, "num_hidden_layers": 1,
                                                          **preset.config}))


class DecoderLayer(nn.Module):
    """Pre-norm attention, then pre-norm MLP (dense, MoE, or whatever module the architecture gives), each added
    to the residual. `mlp_name` is the MLP's checkpoint name ("mlp", Mixtral's "block_sparse_moe")."""

    def __init__(self, index: int, *, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, mlp_name: str = "mlp"):
        super().__init__()
        self.layer_idx, self.mlp_name = index, mlp_name
        self.self_attn = self_attn
        self.add_module(mlp_name, mlp)
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                context: AttentionContext | None = None) -> torch.Tensor:  # x [B, T, H] or, with context, [T, H]
        x = x + self.self_attn(self.input_layernorm(x), positions, context, self.layer_idx)
        return x + self.get_submodule(self.mlp_name)(self.post_attention_layernorm(x))

    @property
    def adds_in_norms(self) -> bool:
        """Whether forward_residual computes this layer: both norms are RMSNorms (their add_and_norm), and forward
        is this class's own."""
        return (type(self).forward is DecoderLayer.forward and isinstance(self.input_layernorm, RMSNorm)
                and isinstance(self.post_attention_layernorm, RMSNorm))

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                         context: AttentionContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward with each residual add done by the norm after it (RMSNorm.add_and_norm: one pass, not an add
        and a norm). The layer's input is x + residual (residual None: x); returns (mlp output, residual), whose
        sum is its output, left for the next norm to add. The same values as forward, bit for bit."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        attn = self.self_attn(h, positions, context, self.layer_idx)
        h, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        return self.get_submodule(self.mlp_name)(h), residual
