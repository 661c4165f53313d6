"""The model runner: a ScheduledBatch -> flat input ids + AttentionContext -> model -> logits of the sequences
that sample this step -> Sampler -> one token id each.

    input_ids [T] = seq 0's new tokens | seq 1's new tokens | ...   (T = batch.num_tokens)
    positions [T], slot_mapping [T]: from each sequence's num_computed_tokens and block table
    logits_indices [B]: the last new token of each sampling sequence
"""
from __future__ import annotations

import torch
from torch import nn

from cpumoe.engine.kv_cache import KVCache
from cpumoe.engine.sampling import Sampler
from cpumoe.engine.scheduler import ScheduledBatch
from cpumoe.models.blocks import AttentionContext


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache):
        self.model, self.kv_cache = model, kv_cache
        self.sampler = Sampler()

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionContext, list[int]]:
        bs = self.kv_cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, tables, logits_indices = [], [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            tables.append(torch.tensor(seq.block_table[:-(-end // bs)], dtype=torch.long))
            if batch.samples(i):
                logits_indices.append(len(ids) - 1)
        context = AttentionContext(positions=torch.tensor(positions, dtype=torch.long), query_lens=query_lens,
                                   context_lens=context_lens, slot_mapping=torch.tensor(slots, dtype=torch.long),
                                   block_tables=tables, kv_caches=self.kv_cache.layers)
        return torch.tensor(ids, dtype=torch.long), context, logits_indices

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """Compute the batch's new tokens into the cache; the sampled token of each sampling sequence, in order."""
        input_ids, context, logits_indices = self.prepare(batch)
        logits = self.model(input_ids, context=context,
                            logits_indices=torch.tensor(logits_indices, dtype=torch.long))  # [B, V] float32
        if not logits_indices:
            return []
        sampling = [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)]
        tokens = self.sampler.sample(logits, [s.params for s in sampling], [s.generator for s in sampling])
        return tokens.tolist()
