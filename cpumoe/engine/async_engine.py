"""AsyncEngine: LLMEngine for asyncio servers. One background thread owns the LLMEngine and steps it while
requests exist; coroutines talk to it through a command list and per-request asyncio queues.

    generate(id, ids, params) -> ("add", ...) -> engine thread: add_request, step(), step(), ...
                              <- RequestOutput per step, put on the request's queue with call_soon_threadsafe
    consumer closes the iterator early (client gone) -> ("abort", id) -> its KV blocks are freed

Hooks: `on_token` callbacks (request_id, is_first, t) run in the engine thread for every generated token
(t = time.perf_counter()), enough for TTFT and inter-token latency; `stats()` also counts tokens processed.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import torch

from cpumoe.engine.api import EngineShutdown, RequestOutput, SamplingParams
from cpumoe.engine.config import EngineConfig
from cpumoe.engine.engine import LLMEngine

log = logging.getLogger(__name__)

TokenHook = Callable[[str, bool, float], None]


class AsyncEngine:
    """engine: an LLMEngine, or a function that makes one, called in the engine thread. Prefer the function
    (from_path does): torch's OpenMP pool belongs to the thread that first runs parallel work, and a model loaded in
    one thread and stepped in another keeps two pools on the same cores; decode steps then took 10-12 ms instead of
    8-9 (2 cores, a 4-layer model at batch 4)."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], *, model_name: str | None = None):
        self.on_token: list[TokenHook] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._commands: list[tuple] = []
        self._outbox: list[tuple] = []   # (loop, queue, item) the engine thread hands over at its next _flush
        self._cv = threading.Condition()
        self._stopping = False
        self._drained: str | None = None   # drain()'s message: new requests are refused with it
        failed: list[BaseException] = []
        ready = threading.Event()

        def run() -> None:
            try:
                self.engine: LLMEngine = engine() if callable(engine) else engine
            except BaseException as e:   # raised again in the constructor's thread
                failed.append(e)
                return
            finally:
                ready.set()
            self._loop()
        self._thread = threading.Thread(target=run, name="cpumoe-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        self.model_name = model_name or self.engine.model_path.name

    @classmethod
    def from_path(cls, model_path: str | Path, *, dtype: torch.dtype | None = None, backend: str = "auto",
                  config: EngineConfig | None = None, model_name: str | None = None,
                  skip_tokenizer: bool = False) -> "AsyncEngine":
        """The engine loaded in the thread that will step it (see the class)."""
        return cls(lambda: LLMEngine(model_path, dtype=dtype, backend=backend, config=config,
                                     skip_tokenizer=skip_tokenizer), model_name=model_name)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def stats(self) -> dict[str, int]:
        return dict(self.engine.stats(), tokens_processed=self.engine.num_tokens_processed,
                    tokens_generated=self.engine.num_tokens_generated)

    # ---- requests ---------------------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """The request's RequestOutputs as the engine produces them; the last one has finished=True. Raises the
        engine's ValueError for a bad request (empty or too long prompt, duplicate id)."""
        if self._drained is not None:
            raise EngineShutdown(self._drained)
        if request_id in self._queues:
            raise ValueError(f"request {request_id!r} already exists")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        self._submit(("add", request_id, list(prompt_token_ids), params or SamplingParams()))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the consumer went away: free the request's KV blocks
                self._submit(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def drain(self, message: str) -> None:
        """End every request in flight with EngineShutdown(message) (after the step under way), and refuse new
        ones: what a server does when its shutdown grace period is over."""
        self._drained = message
        self._submit(("drain", message))

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=10)

    # ---- the engine thread ------------------------------------------------------------------------------------

    def _submit(self, command: tuple) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Queues item for its request's consumer; _flush hands them over."""
        target = self._queues.get(request_id)
        if target is not None:
            self._outbox.append(target + (item,))

    def _flush(self) -> None:
        """One call_soon_threadsafe per event loop for all that a pass of the engine thread delivers, not one per
        request: each call writes to the loop's wake-up pipe and queues a callback of its own."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for loop, queue, item in outbox:
            by_loop.setdefault(loop, []).append((queue, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:   # that loop is closed: nobody is waiting there any more
                pass

    def _loop(self) -> None:
        engine = self.engine
        while True:
            self._flush()
            with self._cv:
                while not (self._commands or self._stopping or engine.has_unfinished()):
                    self._cv.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            for command in commands:
                if command[0] == "add":
                    _, request_id, ids, params = command
                    try:
                        engine.add_request(request_id, ids, params)
                    except ValueError as e:
                        self._deliver(request_id, e)
                elif command[0] == "drain":
                    for request_id in list(engine.seqs):
                        engine.abort(request_id)
                        self._deliver(request_id, EngineShutdown(command[1]))
                else:
                    engine.abort(command[1])
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a failed step fails every request in flight
                log.exception("engine step failed")
                for request_id in list(engine.seqs):
                    engine.abort(request_id)
                    self._deliver(request_id, RuntimeError(f"engine step failed: {e}"))
                engine.step()  # drop the abort outputs
                continue
            t = time.perf_counter()
            for out in outputs:
                # a step can give a request several tokens (accepted drafts): each is a token to the hooks
                first = out.completion_tokens - len(out.new_token_ids) + 1
                for n in range(first, first + len(out.new_token_ids)):
                    for hook in self.on_token:
                        try:
                            hook(out.request_id, n == 1, t)
                        except Exception:
                            log.exception("on_token hook failed")
                # a request that failed alone (its sampling or detokenization) ends as a failed step would
                self._deliver(out.request_id, RuntimeError(out.error) if out.error else out)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
