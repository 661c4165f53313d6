"""LLMEngine: requests in, RequestOutputs out, one step at a time.

    add_request(id, prompt_token_ids, params) -> Sequence -> Scheduler.waiting
    step():  [propose(): drafts for decoding sequences, with speculative decoding]
             schedule() -> ScheduledBatch  ->  run(): ModelRunner (KV cache, model, Sampler or verification)
             -> new tokens per sampling seq (one; with drafts, the accepted drafts and one more)
             -> postprocess(): append, detokenize, finish (eos / stop token / stop string -> "stop";
                max_tokens or max_model_len -> "length"), free finished sequences' blocks -> [RequestOutput]
    abort(id): frees the blocks at once; the next step() reports it with finish_reason "abort".
"""
from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import torch

from cpumoe.engine.api import RequestOutput, SamplingParams
from cpumoe.engine.config import EngineConfig, SpeculativeConfig
from cpumoe.engine.detokenize import IncrementalDetokenizer
from cpumoe.engine.kv_cache import KVCache
from cpumoe.engine.runner import ModelRunner
from cpumoe.engine.sampling import FAILED, make_generator
from cpumoe.engine.scheduler import ScheduledBatch, Scheduler, Sequence, SequenceStatus
from cpumoe.engine.speculative import draft_budget, make_proposer
from cpumoe.loader import Checkpoint, CheckpointError
from cpumoe.models import load_model

log = logging.getLogger(__name__)


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def load_tokenizer(path: str | Path):
    """transformers.AutoTokenizer from the checkpoint directory, or None when it has no tokenizer."""
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises whatever the broken file provokes (KeyError, JSON, type errors)
        files = ", ".join(f for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")
                          if (Path(path) / f).is_file())
        raise CheckpointError(f"{path}: the tokenizer ({files}) cannot be loaded: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")) from None


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def _check_max_model_len(hf_config: dict, config: EngineConfig) -> None:
    """A max_model_len past the checkpoint's max_position_embeddings asks for positions the model never saw in
    training (its RoPE, or YaRN's scaled range, ends there): refused unless allow_long_max_model_len."""
    positions = hf_config.get("max_position_embeddings")
    if (config.max_model_len is not None and isinstance(positions, int) and config.max_model_len > positions
            and not config.allow_long_max_model_len):
        raise ValueError(f"max_model_len {config.max_model_len} is above the model's max_position_embeddings "
                         f"{positions} (positions it was not trained on); allow it explicitly with "
                         "allow_long_max_model_len (cpumoe serve --allow-long-max-model-len)")


class LLMEngine:
    def __init__(self, model_path: str | Path, *, dtype: torch.dtype | None = None, backend: str = "auto",
                 config: EngineConfig | None = None, skip_tokenizer: bool = False):
        """skip_tokenizer: load no tokenizer (prompts are token ids, outputs carry no text)."""
        self.config = config = config or EngineConfig()
        self.model_path = Path(model_path)
        # what fails fast, before minutes of loading: config.json and the weight headers, the context length, the
        # tokenizer (which reads config.json too: checked first, so its errors name the right file)
        hf_config = Checkpoint(self.model_path).config
        # a multimodal checkpoint (llama4, gemma4) keeps its language model's eos ids and context in text_config
        hf_config = {**hf_config, **(hf_config.get("text_config") or {})}
        _check_max_model_len(hf_config, config)
        self.tokenizer = None if skip_tokenizer else load_tokenizer(model_path)
        self.model = load_model(model_path, dtype=dtype, backend=backend)
        if config.batch_invariant:
            self.model.make_batch_invariant()
            log.info("batch invariant: every token's attention runs as a row of its own of the decode kernel")
        mc = self.model.config
        self.dtype = self.model.model.embed_tokens.weight.dtype
        # The ids the model can embed; a tokenizer may know more (added tokens past the embedding's rows).
        self.vocab_size = self.model.model.embed_tokens.weight.shape[0]

        self.eos_token_ids = _ids(hf_config.get("eos_token_id"))
        gen_config = self.model_path / "generation_config.json"
        if gen_config.is_file():
            self.eos_token_ids |= _ids(json.loads(gen_config.read_text()).get("eos_token_id"))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        shape = dict(num_layers=mc.num_hidden_layers, block_size=config.block_size, layout=self.model.kv_cache_layout,
                     dtype=self.dtype)
        num_blocks = config.num_blocks or config.kv_cache_bytes // KVCache.bytes_per_block(**shape)
        capacity = num_blocks * config.block_size
        max_len = config.max_model_len or hf_config.get("max_position_embeddings") or capacity
        if config.max_model_len is None:
            max_len = min(max_len, capacity)
        if max_len > capacity:
            raise ValueError(f"max_model_len {max_len} does not fit the KV cache ({num_blocks} blocks of "
                             f"{config.block_size} tokens = {capacity}); raise kv_cache_bytes or num_blocks")
        if max_len < 2:
            raise ValueError(f"the KV cache holds {capacity} tokens: too small (kv_cache_bytes / num_blocks)")
        self.max_model_len = max_len
        self.kv_cache = KVCache(num_blocks=num_blocks, **shape)
        self.scheduler = Scheduler(config, num_blocks)
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.generator = torch.Generator().manual_seed(config.seed)  # requests without a seed
        self.seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []   # aborts, reported by the next step()
        self._arrivals = itertools.count()
        self.num_tokens_processed = 0   # tokens run through the model (prefill + decode)
        self.num_tokens_generated = 0
        self.num_draft_tokens = 0       # speculative decoding: drafts verified, and how many were accepted
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0       # sequence-steps that verified at least one draft
        self.speculative, self.proposer = None, None
        self.last_batch: ScheduledBatch | None = None  # what the last step ran (benchmarks read its make-up)
        self._draft_args = dict(vocab_size=self.vocab_size, dtype=dtype, backend=backend,
                                kv_cache_bytes=config.kv_cache_bytes, block_size=config.block_size)
        self.set_speculative(config.speculative)
        log.info("engine: %s, %d KV blocks x %d tokens, max_model_len %d", self.model_path.name, num_blocks,
                 config.block_size, max_len)

    def make_proposer(self, speculative: SpeculativeConfig):
        """The proposer speculative asks for, for this engine's model (a draft model is loaded here)."""
        return make_proposer(speculative, **self._draft_args)

    def set_speculative(self, speculative: SpeculativeConfig | None, proposer=None) -> None:
        """Speculative decoding on (or off, with None) from the next step; proposer: one made already for the same
        method and draft (benchmarks reuse one draft model across k). Between requests: drafts in flight are
        dropped."""
        if speculative is not None and proposer is None:
            proposer = self.make_proposer(speculative)
        self.speculative, self.proposer = speculative, proposer if speculative is not None else None
        for seq in self.seqs.values():
            seq.spec_token_ids, seq.spec_probs = [], None
        if speculative is not None:
            log.info("speculative decoding: %s, %d tokens", speculative.method, speculative.num_speculative_tokens)

    # ---- requests ---------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.seqs:
            raise ValueError(f"request {request_id!r} already exists")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}) (the model's vocabulary); "
                             f"got {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len}"
                             " (prompt + at least one generated token)")
        detok = (IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids), list(params.stop))
                 if self.tokenizer is not None else None)
        generator = make_generator(params)
        if generator is None and params.temperature > 0:
            generator = self.generator
        seq = Sequence(request_id=request_id, token_ids=list(prompt_token_ids),
                       num_prompt_tokens=len(prompt_token_ids), params=params, generator=generator,
                       detokenizer=detok, arrival=next(self._arrivals))
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Abort a request and free its KV blocks now. False when it is unknown or already finished."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self._pending.append(self._output(seq, [], "", finished=True))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- one step -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.proposer is not None:
            self.propose()
        batch = self.last_batch = self.scheduler.schedule()
        if not batch.seqs:
            return outputs
        tokens = self.runner.run(batch)
        return outputs + self.postprocess(batch, tokens)

    def propose(self) -> None:
        """Drafts for every running sequence that decodes next (its prompt is in the cache)."""
        k = self.speculative.num_speculative_tokens
        seqs = [s for s in self.scheduler.running
                if s.status is SequenceStatus.RUNNING and s.num_computed_tokens == s.num_tokens - 1]
        self.proposer.propose(seqs, [draft_budget(s, k, self.max_model_len) for s in seqs])

    def postprocess(self, batch: ScheduledBatch, tokens: list[list[int]]) -> list[RequestOutput]:
        outputs = []
        sampled = iter(tokens)
        self.num_tokens_processed += batch.num_tokens
        for i, (seq, n, drafts) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.drafts)):
            samples = batch.samples(i)
            seq.spec_token_ids, seq.spec_probs = [], None
            if not samples:
                seq.num_computed_tokens += n
                self.scheduler.computed(seq)
                continue
            new_tokens = next(sampled)
            # the cache holds the sequence's tokens and the drafts accepted (all new tokens but the last)
            seq.num_computed_tokens += n - len(drafts) + len(new_tokens) - 1
            if drafts:
                self.num_verify_steps += 1
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += len(new_tokens) - 1
            outputs.append(self._append(seq, new_tokens))
        return outputs

    def _append(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        """Append a step's tokens to seq one by one until it finishes; what the step gives its client."""
        text, appended, reason = "", [], None
        for token in new_tokens:
            if token == FAILED:
                return self._fail(seq, "sampling failed: the model's logits hold NaN or leave no token")
            seq.token_ids.append(token)
            appended.append(token)
            self.num_tokens_generated += 1
            try:
                piece, hit_stop = seq.detokenizer.add(token) if seq.detokenizer is not None else ("", False)
            except Exception as e:  # noqa: BLE001  (this request's tokenizer state; the batch goes on)
                log.exception("detokenizing request %s failed", seq.request_id)
                return self._fail(seq, f"detokenization failed: {e}")
            text += piece
            p = seq.params
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids or hit_stop:
                reason = "stop"
            elif seq.num_completion_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                if not hit_stop and seq.detokenizer is not None:
                    text += seq.detokenizer.finish()  # what it held back as a possible stop-string start
                self.scheduler.computed(seq)  # its blocks stay cached for a later prompt that repeats it
                self.scheduler.finish(seq, reason)
                del self.seqs[seq.request_id]
                break
        else:
            self.scheduler.computed(seq)
        seq.output_text += text
        return self._output(seq, appended, text, finished=reason is not None)

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        """Ends seq alone with finish_reason "error"; the rest of the batch goes on."""
        self.scheduler.finish(seq, "error")
        del self.seqs[seq.request_id]
        out = self._output(seq, [], "", finished=True)
        out.error = error
        return out

    @staticmethod
    def _output(seq: Sequence, new_token_ids: list[int], text: str, *, finished: bool) -> RequestOutput:
        return RequestOutput(request_id=seq.request_id, new_token_ids=new_token_ids, new_text=text,
                             finished=finished, finish_reason=seq.finish_reason if finished else None,
                             prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_completion_tokens)

    # ---- offline ------------------------------------------------------------------------------------------------

    def encode(self, prompt: str | list[int], *, chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer: pass token ids")
        if chat:
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; one RequestOutput per prompt with all its token ids and text."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        results = {rid: RequestOutput(request_id=rid, new_token_ids=[], new_text="") for rid in ids}
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, self.encode(prompt), p)
        while any(not results[rid].finished for rid in ids):
            for out in self.step():
                if out.request_id in results:
                    r = results[out.request_id]
                    r.new_token_ids += out.new_token_ids
                    r.new_text += out.new_text
                    r.finished, r.finish_reason, r.error = out.finished, out.finish_reason, out.error
                    r.prompt_tokens, r.completion_tokens = out.prompt_tokens, out.completion_tokens
        return [results[rid] for rid in ids]

    def stats(self) -> dict[str, int]:
        bm = self.scheduler.block_manager
        stats = dict(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                     kv_blocks_used=bm.num_used, kv_blocks_total=bm.num_blocks)
        if (huge_pages := getattr(self.model, "huge_pages", None)) is not None:  # as the load left them
            stats.update(packed_weights_bytes=int(huge_pages.advised_gb * 1e9),
                         packed_weights_huge_page_bytes=int(huge_pages.huge_gb * 1e9))
        if bm.enable_prefix_caching:
            stats.update(prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits)
        if self.proposer is not None:
            stats.update(draft_tokens=self.num_draft_tokens, accepted_tokens=self.num_accepted_tokens,
                         verify_steps=self.num_verify_steps)
        return stats
