"""The FastAPI app: routers mounted on one app, every error as OpenAI's error JSON.

    ops     GET /health, GET /metrics
    openai  GET /v1/models, POST /v1/completions, POST /v1/chat/completions
    kb      POST/DELETE /v1/kb/{name}/documents[/{id}], GET /v1/kb/{name}
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI

from kvfuse.server.errors import ApiError, install_handlers
from kvfuse.server.routes import kb, openai, ops
from kvfuse.server.state import Limits, ServerState


def create_app(state: ServerState) -> FastAPI:
    from kvfuse import __version__

    app = FastAPI(title="kvfuse", version=__version__,
                  description="OpenAI-compatible completions over CAG knowledge bases and CacheBlend chunk fusion.")
    app.state.kvfuse = state
    install_handlers(app, state.metrics)
    for module in (ops, openai, kb):
        app.include_router(module.router(state))
    return app


__all__: Sequence[str] = ["ApiError", "Limits", "ServerState", "create_app"]
