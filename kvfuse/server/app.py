"""The FastAPI app: routers mounted on one app, every error as OpenAI's error JSON.

    ops     GET /health, GET /metrics
    openai  GET /v1/models, POST /v1/completions, POST /v1/chat/completions
    kb      POST/DELETE /v1/kb/{name}/documents[/{id}], GET /v1/kb/{name}

Around them, outermost first: every response counted by route and status (`metrics.CountResponses`),
then the body limit (`bodylimit.BodyLimit`). /docs and /redoc load their assets from the installed
fastapi-offline package, never from a CDN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI

from kvfuse.server.bodylimit import BodyLimit
from kvfuse.server.errors import ApiError, install_handlers
from kvfuse.server.metrics import CountResponses
from kvfuse.server.routes import kb, openai, ops, page, replica
from kvfuse.server.state import Limits, ServerState

ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}}}}}
OPEN = {"/health"}  # the operations that never need a key


def create_app(state: ServerState) -> FastAPI:
    from fastapi_offline import FastAPIOffline

    from kvfuse import __version__

    app = FastAPIOffline(title="kvfuse", version=__version__,
                         description="OpenAI-compatible completions over CAG knowledge bases and CacheBlend "
                                     "chunk fusion.")
    app.state.kvfuse = state
    install_handlers(app)
    for module in (ops, openai, kb, replica, page):
        app.include_router(module.router(state))
    app.add_middleware(BodyLimit, max_bytes=state.limits.body_limit(state.engine.cfg.max_position_embeddings))
    # added last, so outermost: it counts the body limit's 413s too
    app.add_middleware(CountResponses, metrics=state.metrics, templates=lambda: app.openapi()["paths"])
    app.openapi = lambda: _openapi(app, state)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI, state: ServerState) -> dict[str, Any]:
    """FastAPI's schema, told the truth: invalid bodies get 400 (never 422) in OpenAI's error shape, and
    with keys set every operation but /health takes a bearer key."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    comps = schema.setdefault("components", {})
    comps.setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        comps["schemas"].pop(name, None)
    keyed = state.keys is not None
    if keyed:
        comps["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                               "description": "an API key from the --keys file"}}
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, ops_ in schema.get("paths", {}).items():
        for op in ops_.values():
            responses = op.setdefault("responses", {})
            if responses.pop("422", None) is not None or "requestBody" in op or op.get("parameters"):
                responses["400"] = {"description": "invalid request: the message says what to fix", **error}
            if "requestBody" in op:
                responses["413"] = {"description": "request body too large (--max-body-bytes)", **error}
            if keyed and path not in OPEN and not (path == "/metrics" and state.limits.metrics_public):
                op["security"] = [{"bearer": []}]
                responses["401"] = {"description": "missing or invalid API key", **error}
    app.openapi_schema = schema
    return schema


__all__: Sequence[str] = ["ApiError", "Limits", "ServerState", "create_app"]
