"""The one causal LM every architecture is: modules the Architecture names, assembled.

    input_ids -> arch.embedding -> arch.layer(0 .. N-1) -> arch.final_norm -> lm_head (or the tied embedding)
              -> arch.final_logits -> float32 logits

Two ways in: the whole sequence without a cache (input_ids [B, T] or [T]; reference and tests), or one engine step
of flat tokens of several sequences with an AttentionContext (the paged KV cache), where logits come only for the
rows in `logits_indices` (one per sampling sequence).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cpumoe.attention import AttentionContext, DecodeBatch, KVCacheLayout
from cpumoe.models.architecture import Architecture, DecoderLayer
from cpumoe.models.blocks import RMSNorm
from cpumoe.models.decode_layer import FusedDecodeStep, fused_decode_layer
from cpumoe.models.packed_linear import PackedLinear, QuantizedLinear


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> norm (transformers' `model.` prefix of the checkpoint names)."""

    def __init__(self, embed_tokens: nn.Module, layers: list[nn.Module], norm: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self._adds_in_norms: bool | None = None  # decided on the first forward (see adds_in_norms)
        self.decode_layers: list | None = None  # ops.DecodeLayer per layer, once fused (fuse_decode_layers)
        # called with each fused layer's chosen experts, int32 [T, k]: what hooks on FusedMoE see in the modules
        self.decode_routing_hooks: list[Callable[[torch.Tensor], None]] = []

    def fuse_decode_layers(self) -> str | None:
        """Decode steps run each layer as one C++ call (models/decode_layer.py) when every layer can; returns None
        when they do, else why a layer cannot (the steps run the modules)."""
        plans = []
        for i, layer in enumerate(self.layers):
            plan, why = fused_decode_layer(layer)
            if plan is None:
                self.decode_layers = None
                return f"layer {i}: {why}"
            plans.append(plan)
        self.decode_layers = plans if isinstance(self.norm, RMSNorm) and plans else None
        return None if self.decode_layers is not None else "the final norm is not an RMSNorm"

    def forward(self, input_ids: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        # no context: [B, T] -> [B, T, H]; with context: flat [T] -> [T, H]
        positions = torch.arange(input_ids.shape[-1]) if context is None else context.positions  # [T]
        x = self.embed_tokens(input_ids)  # [B, T, H] or [T, H]
        decode = None if context is None or self.decode_layers is None else context.decode_batch()
        if decode is not None and decode.token_index is None:  # every sequence decodes: the fused layers
            return self._decode_step(x, positions, context, decode)
        if self.adds_in_norms:  # each residual add in the norm after it (DecoderLayer.forward_residual)
            residual = None
            for layer in self.layers:
                x, residual = layer.forward_residual(x, residual, positions, context)
            return self.norm.add_and_norm(x, residual)[0]
        for layer in self.layers:
            x = layer(x, positions, context)
        return self.norm(x)

    def _decode_step(self, x: torch.Tensor, positions: torch.Tensor, context: AttentionContext,
                     decode: DecodeBatch) -> torch.Tensor:  # x [S, H], one token per sequence -> [S, H]
        residual = None
        for layer, plan in zip(self.layers, self.decode_layers):
            cos, sin = layer.self_attn.rotary.for_step(positions, x.dtype, context)
            k_cache, v_cache = context.kv_caches[layer.layer_idx]
            x, residual = plan.forward(x, residual, cos, sin, context.slot_mapping, k_cache, v_cache,
                                       decode.block_table, decode.key_begin, decode.key_end)
            for hook in self.decode_routing_hooks:
                hook(plan.routed_ids())
        return self.norm.add_and_norm(x, residual)[0]

    @property
    def adds_in_norms(self) -> bool:
        """Every layer a DecoderLayer whose norms take the residual adds, and an RMSNorm at the end."""
        if self._adds_in_norms is None:
            self._adds_in_norms = isinstance(self.norm, RMSNorm) and all(
                isinstance(layer, DecoderLayer) and layer.adds_in_norms for layer in self.layers)
        return self._adds_in_norms


class CausalLM(nn.Module):
    def __init__(self, arch: Architecture, config: Any, backend: str = "auto"):
        super().__init__()
        self.arch, self.config = arch, config
        self.model = DecoderModel(arch.embedding(config),
                                  [arch.layer(config, i, backend) for i in range(config.num_hidden_layers)],
                                  arch.final_norm(config))
        # tied: logits use embed_tokens.weight; the checkpoint's lm_head.weight, if any, is not read
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=getattr(config, "lm_head_bias", False)))
        self.decode_step: FusedDecodeStep | None = None  # all-decode steps as one C++ call, once fused (fuse_decode)

    def fuse_decode(self) -> tuple[str | None, str | None]:
        """Decode steps as one C++ call a layer (DecoderModel.fuse_decode_layers) and, where those are, the whole
        step as one (FusedDecodeStep). Returns why the layers are not fused (None: they are), and why the whole
        step is not (None: it is)."""
        self.decode_step = None
        layers_why = self.model.fuse_decode_layers()
        self.decode_step, step_why = FusedDecodeStep.build(self)
        return layers_why, step_why

    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        return self.arch.kv_cache_layout(self.config)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, context: AttentionContext | None = None,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """No context: [B, T] or [T] -> float32 [B, T, V] or [T, V], the whole sequence without a cache.
        With context: flat [T] -> float32 [len(logits_indices), V] (all T rows when logits_indices is None)."""
        if context is not None:
            if self.decode_step is not None and logits_indices is None:
                decode = context.decode_batch()
                if decode is not None and decode.token_index is None:  # every sequence decodes
                    out = self.decode_step.forward(input_ids, context, decode)
                    return out if self.decode_step.runs_lm_head else self.compute_logits(out)
            h = self.model(input_ids, context)  # [T, H]
            return self.compute_logits(h if logits_indices is None else h[logits_indices])
        squeeze = input_ids.dim() == 1
        ids = input_ids[None] if squeeze else input_ids  # [B, T]
        logits = self.compute_logits(self.model(ids))  # [B, T, V]
        return logits[0] if squeeze else logits

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> float32 [..., V]
        if self.lm_head is None:  # tied to the embedding table [V, H]
            logits = torch.nn.functional.linear(h, self.model.embed_tokens.weight).float()
        else:
            logits = self.lm_head(h).float()
        return self.arch.final_logits(self.config, logits)

    def make_batch_invariant(self) -> None:
        """Make every token's result independent of the other tokens in its step and of how its prompt is chunked
        (the engine's batch_invariant): attention runs as cpumoe.attention.row_attention, and the products that
        torch's GEMMs would compute (float32 routers, MLA's absorbed heads, a tied lm_head) get copies packed for
        cpumoe's linear kernel, whose rows never depend on how many there are. The experts and the packed
        projections are so on every backend but those whose sums depend on a call's row count (x86-amx): they move
        to one that packs alike. Each module that needs it has a make_batch_invariant of its own."""
        torch_gemms = [name for name, m in self.named_modules() if type(m) is nn.Linear
                       or (isinstance(m, QuantizedLinear) and m.packed_weight is None)]
        if torch_gemms:
            raise ValueError(f"batch invariance needs cpumoe's kernels for every projection; {torch_gemms[0]} runs on "
                             "torch's GEMM (backend 'naive', or a dtype or format no native backend takes)")
        for module in [m for m in self.modules() if m is not self and hasattr(m, "make_batch_invariant")]:
            module.make_batch_invariant()
        self.model.decode_layers = None  # their attention is the decode kernel over whole tables, not row_attention
        self.decode_step = None
        if self.lm_head is None:
            self.lm_head = PackedLinear(self.model.embed_tokens.weight)
