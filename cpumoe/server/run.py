"""Run the OpenAI-compatible server with uvicorn (one process, one event loop: the engine's requests and the HTTP
connections share it)."""
from __future__ import annotations

import asyncio
import gc
import logging
import resource
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from cpumoe.server.app import EngineClient, create_app
from cpumoe.server.limits import (HEADER_TIMEOUT_S, IDLE_TIMEOUT_S, MAX_CONNECTIONS, MAX_REQUEST_BYTES,
                                  SHUTDOWN_GRACE_S)

log = logging.getLogger("cpumoe.server")

DRAIN_MARGIN_S = 10.0             # then the engine ends them: room for the step under way and the last events


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request line and headers have not all arrived within
    header_timeout seconds of its opening or of its previous response. A client that sends half a header and
    stops would otherwise hold its socket (and a file descriptor) for as long as it likes; enough of them lock
    everyone out."""
    header_timeout = HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if not self._waiting_for_headers() and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _waiting_for_headers(self) -> bool:
        """No request in progress: none yet, or the last one has been answered."""
        return self.cycle is None or self.cycle.response_complete

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            log.debug("closing a connection that sent no complete request in %.0f s", self.header_timeout)
            self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGTERM, Ctrl-C) stops accepting connections, lets the requests in flight
    run for grace_s seconds, then ends the rest through the engine (an error event and `[DONE]` on a stream, a 503
    otherwise) rather than cancelling their tasks mid-response."""

    def __init__(self, config: uvicorn.Config, *, engine, grace_s: float):
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s

    async def shutdown(self, sockets=None) -> None:
        drain = getattr(self.engine, "drain", None)
        timer = None
        if drain is not None:
            message = f"the server is shutting down; this request did not finish within {self.grace_s:g} s"
            timer = asyncio.get_running_loop().call_later(self.grace_s, drain, message)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()
        # uvicorn raises the signal it caught again once it has shut down, so the process would end "killed by
        # SIGTERM"; after a drain that ended every request (no task left for uvicorn to cancel) the exit is a clean
        # one (status 0).
        if not self.server_state.tasks:
            getattr(self, "_captured_signals", []).clear()


def raise_open_file_limit() -> int:
    """Raises this process's soft limit on open files to its hard limit (the common soft limit, 1024, is what a
    flood of connections exhausts first). Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def server_config(app, host: str, port: int, *, log_level: str = "info",
                  max_connections: int = MAX_CONNECTIONS,
                  shutdown_grace_s: float = SHUTDOWN_GRACE_S) -> uvicorn.Config:
    """uvicorn's settings for cpumoe: slow headers and idle connections time out, and at most max_connections
    are served at once (beyond that a 503), kept below the open-file limit. uvicorn cancels what is still running
    DRAIN_MARGIN_S after the grace period: by then the engine has ended every request."""
    fd_limit = raise_open_file_limit()
    if max_connections > fd_limit - 64:
        log.warning("--max-connections %d lowered to %d: the open-file limit is %d", max_connections,
                    max(1, fd_limit - 64), fd_limit)
        max_connections = max(1, fd_limit - 64)
    # asyncio's own loop, even where uvloop is installed (uvicorn would take it): with uvloop, 16 streams on 2 cores
    # decoded in 104 ms steps where asyncio's loop gave 75 (README, "Serving under load")
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, loop="asyncio",
                          timeout_graceful_shutdown=shutdown_grace_s + DRAIN_MARGIN_S,
                          http=HeaderTimeoutH11, timeout_keep_alive=IDLE_TIMEOUT_S, limit_concurrency=max_connections)


def freeze_startup_objects() -> None:
    """What loading made (torch, transformers, the model's modules, the app) lives as long as the server: moved out
    of the collector's reach, as vLLM does after start-up. A full collection walks every tracked object with the
    GIL held; over the ~360k a loaded server holds, that took 390-410 ms on a 2-core Zen 3 VM, a stall of every
    stream and of the engine's step whenever the collector decided to run one."""
    gc.collect()
    gc.freeze()
    log.debug("%d objects of start-up frozen out of garbage collection", gc.get_freeze_count())


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: `cpumoe serve` takes its port before it loads a model, so a port in use
    fails in a second, not after minutes of loading. Raises OSError (address in use, no such address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve(engine: EngineClient, host: str = "127.0.0.1", port: int = 8000, *, model_name: str | None = None,
          api_key: str | None = None, log_level: str = "info", sock: socket.socket | None = None,
          max_request_bytes: int = MAX_REQUEST_BYTES, max_connections: int = MAX_CONNECTIONS,
          shutdown_grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Serve `engine` at http://host:port/v1 until interrupted (on `sock` when given, from bind(host, port)).
    `model_name` (default: the engine's) is the name clients must send as `model`."""
    app = create_app(engine, model_name=model_name or engine.model_name, api_key=api_key,
                     max_request_bytes=max_request_bytes)
    config = server_config(app, host, port, log_level=log_level, max_connections=max_connections,
                           shutdown_grace_s=shutdown_grace_s)
    freeze_startup_objects()
    try:
        DrainingServer(config, engine=engine, grace_s=shutdown_grace_s).run(sockets=[sock or bind(host, port)])
    finally:
        shutdown = getattr(engine, "shutdown", None)   # AsyncEngine: stop its stepping thread
        if shutdown is not None:
            shutdown()
