"""The support team's web page: GET / and its assets under /ui/ (packaged with kvfuse: no CDN, no build
step). The page talks to the same API as any client: /v1/me, /v1/chat/completions (streamed),
/v1/kb/{name} and its documents."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

from kvfuse.server.errors import ApiError
from kvfuse.server.state import ServerState

ASSETS = {"app.js": "text/javascript", "app.css": "text/css"}


def _asset(name: str) -> str:
    return str(resources.files("kvfuse").joinpath("server", "static", name))


def router(state: ServerState) -> APIRouter:
    r = APIRouter()

    @r.get("/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(_asset("index.html"), media_type="text/html", headers={"Cache-Control": "no-cache"})

    @r.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return FileResponse(_asset("favicon.ico"), media_type="image/x-icon",
                            headers={"Cache-Control": "public, max-age=86400"})

    @r.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise ApiError(404, f"No page asset {name!r}.", "not_found_error", code="not_found")
        return FileResponse(_asset(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    del state
    return r
