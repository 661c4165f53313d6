"""Run the OpenAI-compatible server with uvicorn (one process, one event loop: the engine's requests and the HTTP
connections share it)."""
from __future__ import annotations

import socket

import uvicorn

from cpumoe.server.app import DEFAULT_MAX_REQUEST_BYTES, EngineClient, create_app


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
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
    """Serve `engine` at http://host:port/v1 until interrupted (on `sock` when given, from bind(host, port)).
    `model_name` (default: the engine's) is the name clients must send as `model`."""
    app = create_app(engine, model_name=model_name or engine.model_name, api_key=api_key,
                     max_request_bytes=max_request_bytes)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock or bind(host, port)])
    finally:
        shutdown = getattr(engine, "shutdown", None)   # AsyncEngine: stop its stepping thread
        if shutdown is not None:
            shutdown()
