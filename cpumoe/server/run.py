"""Run the OpenAI-compatible server with uvicorn (one process, one event loop: the engine's requests and the HTTP
connections share it)."""
from __future__ import annotations

import uvicorn

from cpumoe.server.app import EngineClient, create_app


def serve(engine: EngineClient, host: str = "127.0.0.1", port: int = 8000, *, model_name: str | None = None,
          api_key: str | None = None, log_level: str = "info") -> None:
    """Serve `engine` at http://host:port/v1 until interrupted. `model_name` (default: the engine's) is the name
    clients must send as `model`."""
    app = create_app(engine, model_name=model_name or engine.model_name, api_key=api_key)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        shutdown = getattr(engine, "shutdown", None)   # AsyncEngine: stop its stepping thread
        if shutdown is not None:
            shutdown()
