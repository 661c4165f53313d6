"""An OpenAI-compatible HTTP server over the cpumoe engine: `create_app(engine, model_name=...)` builds the FastAPI
app, `serve(engine, host, port)` runs it with uvicorn. See app.py for the request flow.

Submodules load on first use, so `cpumoe.server.limits` (the defaults the command line shows) stays light.
"""
from __future__ import annotations

__all__ = ["APIError", "EngineClient", "create_app", "serve"]


def __getattr__(name: str):
    if name in ("APIError", "EngineClient", "create_app"):
        from cpumoe.server import app
        return getattr(app, name)
    if name == "serve":
        from cpumoe.server.run import serve
        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
