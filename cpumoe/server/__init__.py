"""An OpenAI-compatible HTTP server over the cpumoe engine: `create_app(engine, model_name=...)` builds the FastAPI
app, `serve(engine, host, port)` runs it with uvicorn. See app.py for the request flow."""
from cpumoe.server.app import APIError, EngineClient, create_app
from cpumoe.server.run import serve

__all__ = ["APIError", "EngineClient", "create_app", "serve"]
