"""GET /health and GET /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvfuse.server.state import ServerState


def router(state: ServerState) -> APIRouter:
    r = APIRouter()

    @r.get("/health")
    async def health() -> JSONResponse:
        ok = state.worker.alive
        return JSONResponse({"status": "ok" if ok else "worker stopped", "model": state.model_id,
                             "queue_depth": state.worker.depth}, 200 if ok else 503)

    @r.get("/metrics")
    async def metrics(request: Request) -> Response:
        state.metrics_reader(request)
        import asyncio

        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        # off the event loop: a tier's sizes may be a network call (Redis INFO, bounded by its timeout)
        body = await asyncio.to_thread(generate_latest, state.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return r
