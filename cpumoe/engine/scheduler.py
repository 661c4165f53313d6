"""Continuous batching with chunked prefill and recompute preemption.

    schedule() -> ScheduledBatch: [(sequence, num_new_tokens)], at most max_num_batched_tokens tokens in all
      1. running sequences, oldest first: a decode (1 token) or the next chunk of an unfinished prefill; when
         the KV cache has no block left for one, the newest running sequence is preempted (blocks freed, sent
         back to the front of the waiting queue, its tokens recomputed later)
      2. waiting sequences, in arrival order, while the budget, max_num_seqs and free blocks allow; a prompt
         longer than what is left of the budget is split into chunks over the next steps
    A sequence samples a token only in the step that computes its last known token. The scheduler owns the
    BlockManager; finished and aborted sequences give back their blocks at once. With prefix caching a waiting
    sequence starts past the blocks of its prompt that another sequence computed already (BlockManager.match_prefix).
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from cpumoe.engine.api import SamplingParams
from cpumoe.engine.config import EngineConfig
from cpumoe.engine.kv_cache import BlockManager


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]                   # prompt, then the completion so far
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    detokenizer: Any = None                # IncrementalDetokenizer, or None without a tokenizer
    arrival: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0           # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # prefix caching: keys of its full computed blocks
    finish_reason: str | None = None
    output_text: str = ""                  # text emitted so far
    spec_token_ids: list[int] = field(default_factory=list)  # drafted tokens for the next step (speculative)
    spec_probs: torch.Tensor | None = None  # [k, V]: the draft's distribution at each draft; None: point masses

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]              # per sequence: tokens computed this step, its drafts included
    drafts: list[list[int]] = field(default_factory=list)  # per sequence: the drafts among them (last)
    preempted: list[Sequence] = field(default_factory=list)
    num_decodes: int = 0                   # sequences past their prompt (a decode, with its drafts); the rest prefill
    num_decode_tokens: int = 0             # their tokens, drafts included

    def __post_init__(self) -> None:
        if not self.drafts:
            self.drafts = [[] for _ in self.seqs]

    def add(self, seq: Sequence, num_new_tokens: int, drafts: list[int] | None = None) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.drafts.append(drafts or [])
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            self.num_decodes += 1
            self.num_decode_tokens += num_new_tokens

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last token this step (so a token is sampled for it)."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] - len(self.drafts[i]) == seq.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int):
        self.config = config
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        bm = self.block_manager

        # 1. running sequences, oldest first; preempt the newest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # a decode's drafts come after its token, as far as the budget and the free blocks allow
            drafts = seq.spec_token_ids[:budget - 1] if n == 1 else []
            if drafts and not bm.can_allocate(seq, seq.num_tokens + len(drafts)):
                drafts = []
            seq.spec_token_ids = drafts
            n += len(drafts)
            while not bm.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, seq.num_computed_tokens + n)
                batch.add(seq, n, drafts)
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: it was the newest, nothing after it is left

        # 2. admit waiting sequences (not in a step that had to preempt: the cache is full)
        while (self.waiting and budget > 0 and not batch.preempted
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            hits = bm.match_prefix(seq)   # a cached prefix is computed already
            seq.num_computed_tokens += hits
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not bm.can_allocate(seq, seq.num_computed_tokens + n):
                self._release(seq)   # the cached blocks it took go back until it can be admitted
                break
            if bm.enable_prefix_caching:
                bm.record_prefix(seq.num_tokens, hits)
            bm.allocate(seq, seq.num_computed_tokens + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        return batch

    def _release(self, seq: Sequence) -> None:
        """Give back all of seq's blocks; it computes from its first token (or a cached prefix) again."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.block_hashes.clear()
        seq.spec_token_ids, seq.spec_probs = [], None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def computed(self, seq: Sequence) -> None:
        """seq's num_computed_tokens grew: its blocks that filled up become a cached prefix others can share."""
        self.block_manager.register(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish or abort seq, wherever it is, and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
