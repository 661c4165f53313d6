"""Batch and chunk invariance (EngineConfig.batch_invariant): a token's logits are bit-identical whether its prompt
is prefilled whole, in chunks of 64 or 7 or one token at a time (a 1-token chunk runs as a decode), or beside other
sequences' prefills and decodes; so a greedy request gives the same tokens alone, among 16 concurrent requests and
with max_num_batched_tokens of 64, 300 and 2048, for every architecture, in bf16 (where a sum in another order
flips near ties). The default mode is checked to differ, so the tests show the mode is what makes them hold.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cpumoe.attention import AttentionContext  # noqa: E402
from tests.engine.test_speculative import NOT_IN_MODELS_FILES, TINY_MODELS  # noqa: E402

BLOCK = 16
PROMPT_LEN = 301  # a budget of 300 leaves a 1-token chunk
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _bf16_model(name: str):
    if name in ("deepseek_v3", *NOT_IN_MODELS_FILES):  # routers stay float32, as from_pretrained keeps them
        return TINY_MODELS[name](torch.bfloat16, max_position_embeddings=1024)
    return TINY_MODELS[name](max_position_embeddings=1024).to(torch.bfloat16)


@pytest.fixture(scope="module", params=list(TINY_MODELS), ids=list(TINY_MODELS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"invariance_{request.param}")
    _bf16_model(request.param).save_pretrained(path)
    return path


def _prompts(n: int = 16) -> list[list[int]]:
    """The request under test first, then others of mixed lengths."""
    g = torch.Generator().manual_seed(0)
    lengths = [PROMPT_LEN, 1, 7, 33, 64, 65, 120, 250, 3, 90, 17, 300, 48, 5, 140, 31][:n]
    return [torch.randint(0, 128, (length,), generator=g).tolist() for length in lengths]


def _engine(path, batch_invariant: bool = True, **config) -> LLMEngine:
    return LLMEngine(path, config=EngineConfig(**{"block_size": BLOCK, "num_blocks": 512, "max_num_seqs": 16,
                                                  "enable_prefix_caching": False, "batch_invariant": batch_invariant,
                                                  **config}))


def _logits_by_schedule(engine: LLMEngine, seqs: list[list[int]], steps: list[list[tuple[int, int]]]):
    """Run the model over `steps` directly, each a list of (sequence, tokens) chunks taken in order; sequence i
    owns cache blocks [64 i, 64 (i + 1)). -> per sequence, float32 logits [len, V] of every token computed."""
    done = [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in steps:
        ids, positions, slots, query_lens, context_lens, tables = [], [], [], [], [], []
        for i, n in step:
            start, end = done[i], done[i] + n
            table = torch.arange(64 * i, 64 * i + -(-end // BLOCK))
            ids += seqs[i][start:end]
            positions += range(start, end)
            slots += [int(table[p // BLOCK]) * BLOCK + p % BLOCK for p in range(start, end)]
            query_lens.append(n)
            context_lens.append(end)
            tables.append(table)
            done[i] = end
        context = AttentionContext(positions=torch.tensor(positions), query_lens=query_lens,
                                   context_lens=context_lens, slot_mapping=torch.tensor(slots),
                                   block_tables=tables, kv_caches=engine.kv_cache.layers)
        out = engine.model(torch.tensor(ids), context=context)  # [T, V]
        for (i, n), rows in zip(step, out.split(query_lens)):
            logits[i].append(rows)
    return [torch.cat(rows) if rows else None for rows in logits]


def _schedules(length: int) -> dict[str, list[list[tuple[int, int]]]]:
    """Ways to compute sequence 0 (`length` tokens): whole; in chunks; token by token; beside sequence 1 (a prompt
    prefilled in 50-token chunks) and sequence 2 (decoding one token a step)."""
    def chunks(size):
        return [[(0, min(size, length - s))] for s in range(0, length, size)]
    mixed, s = [], 0
    while s < length:
        n = min(100, length - s)
        mixed.append([(1, 50), (0, n), (2, 1)] if len(mixed) < 3 else [(0, n), (2, 1)])
        s += n
    return {"whole": [[(0, length)]], "chunks of 64": chunks(64), "chunks of 7": chunks(7),
            "token by token": chunks(1), "among others": mixed}


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["invariant", "default"])
def test_logits_do_not_depend_on_chunking_or_batch(checkpoint, batch_invariant):
    engine = _engine(checkpoint, batch_invariant)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (120, 150, 200)]
    results = {name: _logits_by_schedule(engine, seqs, steps)[0] for name, steps in _schedules(120).items()}
    whole = results.pop("whole")
    differing = [name for name, logits in results.items() if not torch.equal(logits, whole)]
    if batch_invariant:
        assert not differing
    else:  # decode rows and prefill GEMMs sum in other orders: the mode is needed
        assert "token by token" in differing


def test_greedy_tokens_do_not_depend_on_batch_or_budget(checkpoint):
    prompts = _prompts()
    alone = _engine(checkpoint, max_num_batched_tokens=2048).generate(prompts[:1], GREEDY)[0].new_token_ids
    for budget in (64, 300, 2048):
        engine = _engine(checkpoint, max_num_batched_tokens=budget)
        assert engine.generate(prompts[:1], GREEDY)[0].new_token_ids == alone, f"alone, budget {budget}"
        together = engine.generate(prompts[1:8] + prompts[:1] + prompts[8:], GREEDY)
        assert together[7].new_token_ids == alone, f"among 16, budget {budget}"


def test_speculation_keeps_greedy_tokens_in_bf16(checkpoint):
    """A verification step computes k + 1 positions at once; batch-invariant, each is the row a plain decode step
    computes, so n-gram and draft speculation give the tokens greedy decoding gives, in bf16 too."""
    from cpumoe.engine.config import SpeculativeConfig
    prompts = _prompts(4)
    plain = [o.new_token_ids for o in _engine(checkpoint).generate(prompts, GREEDY)]
    for spec in (dict(method="ngram", num_speculative_tokens=3),
                 dict(method="draft", model=str(checkpoint), num_speculative_tokens=2)):
        engine = _engine(checkpoint, speculative=SpeculativeConfig.parse(spec))
        assert [o.new_token_ids for o in engine.generate(prompts, GREEDY)] == plain, spec["method"]
        assert engine.stats()["accepted_tokens"] > 0


def test_the_naive_backend_cannot_be_batch_invariant(checkpoint):
    with pytest.raises(ValueError, match="batch invariance needs cpumoe's kernels"):
        LLMEngine(checkpoint, backend="naive", config=EngineConfig(batch_invariant=True))
