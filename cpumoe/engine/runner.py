"""The model runner: a ScheduledBatch -> flat input ids + AttentionContext -> model -> logits of the sequences
that sample this step -> Sampler (or, for sequences with drafts, speculative verification) -> their new tokens.

    input_ids [T] = seq 0's new tokens | seq 1's new tokens | ...   (T = batch.num_tokens; a sequence's drafts
                    follow its last known token)
    positions [T], slot_mapping [T]: from each sequence's num_computed_tokens and block table
    logits_indices: the last new token of each sampling sequence, and the positions of its drafts before it
"""
from __future__ import annotations

import torch
from torch import nn

from cpumoe.engine.kv_cache import KVCache
from cpumoe.engine.rejection_sampling import verify
from cpumoe.engine.sampling import Sampler
from cpumoe.engine.scheduler import ScheduledBatch
from cpumoe.attention import AttentionContext


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache):
        self.model, self.kv_cache = model, kv_cache
        self.sampler = Sampler()

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionContext, list[int]]:
        bs = self.kv_cache.block_size
        if self._all_decode(batch):
            ends = [seq.num_computed_tokens + 1 for seq in batch.seqs]
            ids, context = AttentionContext.for_decode(
                [seq.token_ids[end - 1] for seq, end in zip(batch.seqs, ends)], ends,
                [seq.block_table[:-(-end // bs)] for seq, end in zip(batch.seqs, ends)], bs, self.kv_cache.layers)
            return ids, context, list(range(len(ends)))
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, tables, logits_indices = [], [], [], []
        for i, (seq, n, drafts) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.drafts)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end - len(drafts)])
            ids.extend(drafts)
            positions.extend(range(start, end))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            tables.append(torch.tensor(seq.block_table[:-(-end // bs)], dtype=torch.long))
            if batch.samples(i):
                logits_indices.extend(range(len(ids) - 1 - len(drafts), len(ids)))
        context = AttentionContext(positions=torch.tensor(positions, dtype=torch.long), query_lens=query_lens,
                                   context_lens=context_lens, slot_mapping=torch.tensor(slots, dtype=torch.long),
                                   block_tables=tables, kv_caches=self.kv_cache.layers)
        return torch.tensor(ids, dtype=torch.long), context, logits_indices

    @staticmethod
    def _all_decode(batch: ScheduledBatch) -> bool:
        """Every sequence runs its last token, and nothing else: one new token, no drafts, and it samples."""
        return bool(batch.seqs) and all(n == 1 and not batch.drafts[i] and batch.samples(i)
                                        for i, n in enumerate(batch.num_new_tokens))

    @torch.inference_mode()
    def logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Compute the batch's new tokens into the cache; float32 logits [R, V] at the logits_indices rows."""
        input_ids, context, logits_indices = self.prepare(batch)
        if logits_indices == list(range(len(input_ids))):   # every row (a decode step): no gather, no torch thread woken
            return self.model(input_ids, context=context)
        return self.model(input_ids, context=context, logits_indices=torch.tensor(logits_indices, dtype=torch.long))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[list[int]]:
        """Compute the batch's new tokens into the cache; per sampling sequence, in order, its new tokens: the one
        sampled, or with drafts the drafts verification accepted and the target's own token after them."""
        logits = self.logits(batch)                                             # [R, V] float32
        sampling = [i for i in range(len(batch.seqs)) if batch.samples(i)]
        if not sampling:
            return []
        seqs = [batch.seqs[i] for i in sampling]
        if not any(batch.drafts[i] for i in sampling):
            tokens = self.sampler.sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
            return [[t] for t in tokens.tolist()]
        return verify(logits, [batch.drafts[i] for i in sampling], [s.spec_probs for s in seqs],
                      [s.params for s in seqs], [s.generator for s in seqs])
