"""Prometheus metrics of one server, in their own registry (two apps in one process do not collide).

    per request:  RequestTimer(arrival) -> output(n_new) per engine output -> finish(reason)
                  -> TTFT, inter-token latency and end-to-end histograms, prompt/generation token counters
    at scrape:    engine.stats() -> running / waiting requests, KV blocks and packed weights (and their share on
                  huge pages) gauges; with speculative decoding,
                  drafted / accepted token counters; with prefix caching, prompt tokens
                  looked up and found

Names follow the Prometheus conventions (`_seconds`, counters exposed with `_total`), prefixed `cpumoe_`.
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Buckets in seconds: CPU decode steps run from a few ms (small models) to seconds (large batches, long prompts).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5, 5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class _EngineStatsCollector(Collector):
    """Gauges read from engine.stats() when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self):
        stats = self._stats()
        for key, name, doc in (
                ("running", "cpumoe_num_requests_running", "Requests in the running batch"),
                ("waiting", "cpumoe_num_requests_waiting", "Requests waiting to be scheduled"),
                ("kv_blocks_used", "cpumoe_kv_blocks_used", "KV cache blocks in use"),
                ("kv_blocks_total", "cpumoe_kv_blocks_total", "KV cache blocks in all")):
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0)))
        for key, name, doc in (  # a model the loader packed
                ("packed_weights_bytes", "cpumoe_packed_weights_bytes", "Packed weights resident after the load"),
                ("packed_weights_huge_page_bytes", "cpumoe_packed_weights_huge_page_bytes",
                 "Of the packed weights, the bytes the kernel put on 2 MB pages at the load")):
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))
        for key, name, doc in (  # with prefix caching, and speculative decoding, only
                ("prefix_cache_queries", "cpumoe_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
                ("prefix_cache_hits", "cpumoe_prefix_cache_hits", "Prompt tokens found in the prefix cache"),
                ("draft_tokens", "cpumoe_spec_decode_num_draft_tokens", "Drafted tokens verified"),
                ("accepted_tokens", "cpumoe_spec_decode_num_accepted_tokens", "Drafted tokens accepted"),
                ("verify_steps", "cpumoe_spec_decode_num_verify_steps", "Sequence-steps that verified drafts")):
            if key in stats:
                yield CounterMetricFamily(name, doc, value=float(stats[key]))


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("cpumoe_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("cpumoe_inter_token_latency_seconds", "Time between successive generated tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("cpumoe_e2e_request_latency_seconds", "Arrival to the last token (requests the engine finished)",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("cpumoe_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=r)
        self.generation_tokens = Counter("cpumoe_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("cpumoe_requests", "Requests that ended, by finish reason", ["finish_reason"],
                                registry=r)
        r.register(_EngineStatsCollector(stats))

    def exposition(self) -> tuple[bytes, str]:
        """The text format body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def start(self, prompt_tokens: int) -> RequestTimer:
        self.prompt_tokens.inc(prompt_tokens)
        return RequestTimer(self)


class RequestTimer:
    """The clock of one request, from its arrival at the server."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._arrival = self._last = time.perf_counter()
        self._first = True
        self._done = False

    def output(self, n_new: int) -> None:
        """An engine output with `n_new` tokens arrived; a step that brings several spreads its gap over them."""
        if n_new <= 0:
            return
        now = time.perf_counter()
        if self._first:
            self._m.ttft.observe(now - self._arrival)
            self._first = False
            n_gaps, gap = 0, 0.0      # tokens that come with the first are not spaced in time
        else:
            n_gaps = n_new
            gap = (now - self._last) / n_new
        for _ in range(n_gaps):
            self._m.itl.observe(gap)
        self._last = now
        self._m.generation_tokens.inc(n_new)

    def finish(self, finish_reason: str | None) -> None:
        if self._done:
            return
        self._done = True
        if finish_reason is not None:   # None: aborted before the engine finished it
            self._m.e2e.observe(time.perf_counter() - self._arrival)
        self._m.requests.labels(finish_reason=finish_reason or "abort").inc()
