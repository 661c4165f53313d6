"""Speculative decoding: a proposer drafts k tokens for each decoding sequence, and one step of the target model
computes all k + 1 positions (its last token, then the drafts); rejection_sampling.verify keeps what the target
agrees with, and adds one token of the target's own.

    propose (n-gram prompt lookup, or a draft model) -> seq.spec_token_ids [k], seq.spec_probs [k, V] | None
    schedule: the sequence's step computes 1 + k tokens            runner: logits at all k + 1 positions -> verify

The KV the target wrote for rejected drafts stays in the cache past num_computed_tokens and is overwritten by the
next step; a draft model keeps a cache of its own, valid up to the longest prefix it shares with the sequence.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cpumoe.engine.config import SpeculativeConfig
from cpumoe.engine.kv_cache import BlockManager, KVCache
from cpumoe.engine.runner import ModelRunner
from cpumoe.engine.sampling import GREEDY_EPS, draw, probabilities
from cpumoe.engine.scheduler import ScheduledBatch, Sequence, SequenceStatus

log = logging.getLogger(__name__)


def draft_budget(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many drafts are worth proposing for seq: a step yields at most k + 1 tokens, and none past max_tokens or
    max_model_len."""
    return max(0, min(k, seq.params.max_tokens - seq.num_completion_tokens - 1, max_model_len - seq.num_tokens - 1))


# ---- proposers --------------------------------------------------------------------------------------------------

class NgramProposer:
    """Prompt lookup: find an earlier occurrence of the sequence's last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) and propose the k tokens that followed it: the latest occurrence that k tokens follow, else
    the earliest (in a loop the latest is followed by fewer than k tokens: X X X X -> X, where the first gives k)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose_one(self, token_ids: list[int], k: int) -> list[int]:
        L = len(token_ids)
        if k < 1 or L < self.min_n + 1:
            return []
        tokens = torch.tensor(token_ids, dtype=torch.long)                    # [L]
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = tokens[:L - 1].unfold(0, n, 1)                          # [L - n, n]: every earlier n-gram
            hits = (windows == tokens[L - n:]).all(dim=1).nonzero()           # starts of matches
            if len(hits):
                ends = hits.flatten() + n                                     # where what followed each starts
                full = ends[ends + k <= L]
                start = int(full[-1]) if len(full) else int(ends[0])
                return token_ids[start:start + k]
        return []

    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        for seq, k in zip(seqs, ks):
            seq.spec_token_ids, seq.spec_probs = self.propose_one(seq.token_ids, k), None


@dataclass(slots=True, eq=False)
class _DraftState:
    """The draft model's view of one sequence (what ModelRunner.prepare reads of a Sequence)."""
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    """A smaller checkpoint with the target's vocabulary drafts k tokens one step at a time, in a KV cache of its
    own. Greedy requests draft by argmax; sampled ones draw from the draft's distribution under the request's
    temperature/top-k/top-p, and their q rows go to verification."""

    def __init__(self, config: SpeculativeConfig, *, vocab_size: int, dtype: torch.dtype | None, backend: str,
                 kv_cache_bytes: int, block_size: int):
        from cpumoe.models import load_model
        self.model = load_model(config.model, dtype=dtype, backend=backend)
        draft_vocab = self.model.model.embed_tokens.weight.shape[0]
        if draft_vocab != vocab_size:
            raise ValueError(f"the draft model {config.model} has {draft_vocab} token embeddings, the target "
                             f"{vocab_size}: a draft must share the target's vocabulary")
        mc = self.model.config
        shape = dict(num_layers=mc.num_hidden_layers, block_size=block_size, layout=self.model.kv_cache_layout,
                     dtype=self.model.model.embed_tokens.weight.dtype)
        num_blocks = max(1, kv_cache_bytes // KVCache.bytes_per_block(**shape))
        self.block_manager = BlockManager(num_blocks, block_size)
        self.runner = ModelRunner(self.model, KVCache(num_blocks=num_blocks, **shape))
        self.states: dict[Sequence, _DraftState] = {}
        log.info("speculative: draft model %s, %d KV blocks", Path(config.model).name, num_blocks)

    def release(self) -> None:
        """Give back the cache of sequences that have finished."""
        for seq in [s for s in self.states if s.status is SequenceStatus.FINISHED]:
            self.block_manager.free(self.states.pop(seq))

    def _state(self, seq: Sequence) -> _DraftState:
        state = self.states.get(seq)
        if state is None:
            state = self.states[seq] = _DraftState(token_ids=[])
        # the draft's cache holds what it computed of the longest prefix it still shares with the sequence
        shared = 0
        for shared, (a, b) in enumerate(zip(state.token_ids[:state.num_computed_tokens], seq.token_ids)):
            if a != b:
                break
        else:
            shared = min(state.num_computed_tokens, seq.num_tokens)
        state.num_computed_tokens = shared
        state.token_ids = list(seq.token_ids)
        return state

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        self.release()
        active = []
        for seq, k in zip(seqs, ks):
            seq.spec_token_ids, seq.spec_probs = [], None
            state = self._state(seq)
            # room for the catch-up tokens and the k - 1 drafts it feeds back
            if k > 0 and self.block_manager.can_allocate(state, seq.num_tokens + k - 1):
                self.block_manager.allocate(state, seq.num_tokens + k - 1)
                active.append((seq, state, k, []))
        for step in range(max((k for _, _, k, _ in active), default=0)):
            rows = [a for a in active if a[2] > step]
            batch = ScheduledBatch([state for _, state, _, _ in rows],
                                   [state.num_tokens - state.num_computed_tokens for _, state, _, _ in rows])
            logits = self.runner.logits(batch)                                         # [R, V]
            params = [seq.params for seq, _, _, _ in rows]
            greedy = [p.temperature < GREEDY_EPS for p in params]
            ids = logits.argmax(dim=-1)                                                # [R]
            if not all(greedy):
                sampled = [r for r, g in enumerate(greedy) if not g]
                probs = probabilities(logits[sampled], [params[r] for r in sampled])  # [R', V]
                for j, r in enumerate(sampled):
                    if not torch.isfinite(probs[j]).all() or probs[j].sum() <= 0:
                        continue  # no distribution: this draft ends (argmax kept, q left a point mass)
                    ids[r] = draw(probs[j:j + 1], rows[r][0].generator)[0]
                    rows[r][3].append((step, probs[j]))
            for (seq, state, _, _), n, token in zip(rows, batch.num_new_tokens, ids.tolist()):
                state.num_computed_tokens += n
                state.token_ids.append(token)
                seq.spec_token_ids.append(token)
        for seq, _, k, q_rows in active:
            if q_rows:
                probs = torch.zeros(k, self.model.model.embed_tokens.weight.shape[0])
                probs[range(k), seq.spec_token_ids] = 1.0  # rows that did not sample: a point mass
                for step, row in q_rows:
                    probs[step] = row
                seq.spec_probs = probs


def make_proposer(config: SpeculativeConfig, **draft_args) -> "NgramProposer | DraftModelProposer":
    if config.method == "ngram":
        return NgramProposer(config)
    return DraftModelProposer(config, **draft_args)
