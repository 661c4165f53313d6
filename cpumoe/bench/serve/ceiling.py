"""The client's own ceiling: how many streamed token chunks per second it can take in on one core.

A flood server (flood.py) in a child process, so it does not share the client's interpreter or core, answers a
POST with an SSE stream of `chunks` completion events written in large blocks as fast as the socket takes them.
The client reads it with the same `stream_request` a benchmark uses (parsing, timestamps, bookkeeping), and the
rate it achieves is its ceiling: a server that streams near it measures the client, not the server.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FLOOD = Path(__file__).with_name("flood.py")


@dataclass(frozen=True, slots=True)
class Ceiling:
    chunks: int
    seconds: float      # POST to the last chunk

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.seconds


def client_ceiling(chunks: int = 100_000) -> Ceiling:
    """Stream `chunks` token chunks from a local flood server through the benchmark's client; the time it took.
    100,000 chunks take about half a second on a 2-core x86 VM (about 200,000 chunks/s)."""
    import aiohttp

    from cpumoe.bench.serve.client import RequestOutput, Target, stream_request

    if chunks < 1:
        raise ValueError(f"chunks must be positive, got {chunks}")
    child = subprocess.Popen([sys.executable, str(FLOOD), str(chunks)], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the flood server did not start (exit status {child.poll()})")
        target = Target(base_url=f"http://127.0.0.1:{int(line)}", model="flood", endpoint="completions")

        async def measure() -> RequestOutput:
            out = RequestOutput(prompt_len=1, asked_output_len=chunks)
            async with aiohttp.ClientSession() as session:
                await stream_request(session, target, b"{}", out)
            return out

        out = asyncio.run(measure())
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()
    if not out.success or len(out.token_times) != chunks:
        raise RuntimeError(f"the flood stream failed: {out.error or f'{len(out.token_times)} of {chunks} chunks'}")
    return Ceiling(chunks=chunks, seconds=out.latency)
