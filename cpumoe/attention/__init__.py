"""Attention over the engine's paged KV cache, shared by the models (which attend) and the engine (which owns the
cache and builds each step's context): the step context, the cache layout, paged decode and prefill.

    context.py  AttentionContext (one step's tokens, slots, block tables, caches), DecodeBatch
    layout.py   KVCacheLayout (what a token of a layer keeps: K and V heads and widths)
    paged.py    paged_attention, decode_attention (+ its torch reference), row_attention (batch-invariant)
    prefill.py  causal_attention (one prefill chunk over its context: ops.prefill_attention or blocked causal GEMMs)
                (+ its torch reference)
"""
from cpumoe.attention.context import AttentionContext, DecodeBatch
from cpumoe.attention.layout import KVCacheLayout
from cpumoe.attention.paged import decode_attention, decode_attention_reference, paged_attention, row_attention
from cpumoe.attention.prefill import causal_attention

__all__ = ["AttentionContext", "DecodeBatch", "KVCacheLayout", "causal_attention", "decode_attention",
           "decode_attention_reference", "paged_attention", "row_attention"]
