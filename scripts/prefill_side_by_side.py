"""Prefill of one prompt length on several checkpoints, all loaded together, each prompt prefilled by every engine
in turn so that the ratios come from the same seconds: the prefill speed-ups of `cpumoe quantize` twins over their
bf16 source with more samples than `cpumoe bench model` takes (one prompt per engine a repetition).

    .venv/bin/python scripts/prefill_side_by_side.py CKPT CKPT-int8 CKPT-int4 [--prompts 10] [--input-len 512]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="checkpoint directories; ratios are against the first")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--input-len", type=int, default=512)
    args = parser.parse_args()
    config = EngineConfig(block_size=16, num_blocks=args.input_len // 16 + 2, enable_prefix_caching=False,
                          max_num_seqs=1, max_num_batched_tokens=max(1024, args.input_len),
                          max_model_len=args.input_len + 16)
    engines = [LLMEngine(path, config=config) for path in args.models]
    vocab = engines[0].model.config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    seconds: list[list[float]] = [[] for _ in engines]
    for i in range(args.prompts):
        prompt = torch.randint(0, vocab, (args.input_len,), generator=g).tolist()
        for engine, times in zip(engines, seconds):
            engine.add_request(f"prefill-{i}", prompt, params)
            start = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            times.append(time.perf_counter() - start)
    base = statistics.median(seconds[0])
    print(f"prefill of {args.input_len} tokens, {args.prompts} prompts, {torch.get_num_threads()} threads")
    for path, times in zip(args.models, seconds):
        ratios = [a / b for a, b in zip(seconds[0], times)]
        print(f"{Path(path).name:32s} median {statistics.median(times) * 1e3:7.1f} ms "
              f"({min(times) * 1e3:.0f}-{max(times) * 1e3:.0f})   vs first {base / statistics.median(times):.2f}x "
              f"(per prompt {min(ratios):.2f}-{max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
