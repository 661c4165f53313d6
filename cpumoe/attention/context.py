"""Where one engine step's tokens belong (AttentionContext) and its decoding sequences batched for one kernel call
(DecodeBatch). Built by the engine's runner, read by every attention layer of the model."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class AttentionContext:
    """Where one engine step's flat tokens belong: S sequences, T = sum(query_lens) tokens, sequence i's tokens
    contiguous and in order. Sequence i has context_lens[i] tokens in all (cached + new); its query_lens[i] new
    tokens are the last ones (a prefill chunk, or 1 for a decode) and attend causally to all of them.

    positions [T] long            position of each new token in its sequence (RoPE)
    slot_mapping [T] long         where each new token's K/V goes: block * block_size + offset
    block_tables list of [n_i] long  sequence i's cache blocks, in order (n_i * block_size >= context_lens[i])
    kv_caches                     per layer (k, v): [num_blocks, block_size, nkv, k_dim] and [..., nkv, v_dim] in
                                  the model dtype, as the model's KVCacheLayout says (GQA: k_dim = v_dim = d;
                                  MLA's latent cache: one "head" of kv_lora_rank + rope dims and an empty V)
    cache                         per-step values every layer shares (rotary cos/sin, the decode block table),
                                  built by the first layer that needs them
    """
    positions: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor
    block_tables: list[torch.Tensor]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    cache: dict = field(default_factory=dict)

    @classmethod
    def for_decode(cls, token_ids: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, "AttentionContext"]:
        """A step where every sequence decodes one token (its last, token_ids[i], at position context_lens[i] - 1):
        (input_ids [S], the context with its DecodeBatch built). Ids, positions, slots, lengths and the padded
        block tables are views of one tensor, one list conversion for the step's integers where the general path
        makes ~5 tensors and one a sequence (each costs 10-60 us after a step has streamed its weights)."""
        S, n = len(token_ids), max(len(t) for t in block_tables)
        positions = [c - 1 for c in context_lens]
        slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(block_tables, positions)]
        flat = [*token_ids, *positions, *slots, *context_lens, *[0] * S]
        for t in block_tables:
            flat += t
            flat += [0] * (n - len(t))  # padded with block 0, as DecodeBatch.build pads
        values = torch.from_numpy(np.array(flat, dtype=np.int64))  # a third of torch.tensor(flat)'s time
        ids, position_rows, slot_mapping, lens, key_begin, table = values.split([S] * 5 + [S * n])  # [S] each, [S * n]
        table = table.view(S, n)
        context = cls(positions=position_rows, query_lens=[1] * S, context_lens=list(context_lens),
                      slot_mapping=slot_mapping, block_tables=[table[i, :len(t)] for i, t in enumerate(block_tables)],
                      kv_caches=kv_caches)
        context.cache["decode"] = DecodeBatch(token_index=None, block_table=table, seq_rows=list(range(S)), lens=lens,
                                              block_size=block_size, key_begin=key_begin, key_end=lens)
        return ids, context

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of the step as a row of its own: block_table [T, n] (its sequence's table, padded with block
        0) and key_end [T] = position + 1 (a token sees the keys up to itself). Built once per step."""
        if "rows" not in self.cache:
            n = max(t.numel() for t in self.block_tables)
            tables = torch.zeros(len(self.block_tables), n, dtype=torch.long)  # [S, n]
            for i, t in enumerate(self.block_tables):
                tables[i, :t.numel()] = t
            rows = tables.repeat_interleave(torch.tensor(self.query_lens), dim=0)  # [T, n]
            self.cache["rows"] = rows, self.positions + 1
        return self.cache["rows"]

    def decode_batch(self) -> "DecodeBatch | None":
        """The sequences that decode (query_lens 1) this step, as padded tensors; None when there are none."""
        if "decode" not in self.cache:
            rows = [i for i, q in enumerate(self.query_lens) if q == 1]
            self.cache["decode"] = DecodeBatch.build(self, rows) if rows else None
        return self.cache["decode"]


@dataclass(slots=True)
class DecodeBatch:
    """The decoding sequences of a step, batched for one attention call per layer.

    token_index [S] long or None   their tokens' rows in the step's flat tokens (None: every row, in order)
    block_table [S, n] long        block tables padded (with block 0) to the longest
    lens [S] long                  context lengths (the query is the last token)
    key_begin, key_end [S] long    the same keys as a range of positions over each table (what the kernel takes)
    valid [S, 1, 1, n * block_size] bool   key positions inside [key_begin, key_end): for the torch maths (the
                                   reference, MLA), made on first use, not at every step for the kernel
    """
    token_index: torch.Tensor | None
    block_table: torch.Tensor
    seq_rows: list[int]
    lens: torch.Tensor
    block_size: int
    key_begin: torch.Tensor
    key_end: torch.Tensor
    _valid: torch.Tensor | None = None
    _windows: dict = field(default_factory=dict)  # sliding window -> its DecodeBatch (see windowed)

    @property
    def valid(self) -> torch.Tensor:
        if self._valid is None:
            key_pos = torch.arange(self.block_table.shape[1] * self.block_size)[None, :]  # [1, L]
            self._valid = ((key_pos >= self.key_begin[:, None]) & (key_pos < self.key_end[:, None]))[:, None, None, :]
        return self._valid

    @classmethod
    def build(cls, context: AttentionContext, rows: list[int]) -> "DecodeBatch":
        # one C++ call pads the tables (a Python loop of row copies took ~30 us a decode step at one sequence)
        table = torch.nn.utils.rnn.pad_sequence([context.block_tables[i] for i in rows], batch_first=True)  # [S, n]
        block_size = context.kv_caches[0][0].shape[1] if context.kv_caches else 1
        lens = torch.tensor([context.context_lens[i] for i in rows], dtype=torch.long)  # [S]
        index = None
        if len(rows) != len(context.query_lens):
            starts = [0]
            for q in context.query_lens:
                starts.append(starts[-1] + q)
            index = torch.tensor([starts[i] for i in rows], dtype=torch.long)
        return cls(token_index=index, block_table=table, seq_rows=rows, lens=lens, block_size=block_size,
                   key_begin=torch.zeros_like(lens), key_end=lens)

    def windowed(self, window: int) -> "DecodeBatch":
        """The same sequences over their last `window` keys only (sliding-window layers: the query at position
        len - 1 sees keys len - window .. len - 1): block tables start at the block holding key len - window, so a
        layer reads O(window) keys, not the whole context. Built once per step and window."""
        if window not in self._windows:
            bs = self.block_size
            first = (self.lens - window).clamp(min=0) // bs  # [S] first block needed
            n = int((-(-self.lens // bs) - first).max())  # blocks in the longest window
            cols = (first[:, None] + torch.arange(n)[None, :]).clamp(max=self.block_table.shape[1] - 1)  # [S, n]
            table = self.block_table.gather(1, cols)  # [S, n]
            key_end = self.lens - first * bs  # positions over the windowed table
            self._windows[window] = DecodeBatch(token_index=self.token_index, block_table=table,
                                                seq_rows=self.seq_rows, lens=self.lens, block_size=bs,
                                                key_begin=(key_end - window).clamp(min=0), key_end=key_end)
        return self._windows[window]
