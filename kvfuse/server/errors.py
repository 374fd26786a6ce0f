"""Errors as OpenAI's JSON `{error: {message, type, param, code}}`; validation errors are 400, not 422."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfuse.kb.manifest import KBError
from kvfuse.request import ModeUnavailableError, RequestError


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def as_api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, KBError | RequestError | ModeUnavailableError):
        return ApiError(400, str(e))
    if isinstance(e, asyncio.CancelledError):
        return ApiError(499, "The request was cancelled.", code="cancelled")
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


def busy(retry_after: int, what: str = "The server is busy") -> ApiError:
    return ApiError(429, f"{what}; retry in {retry_after} s.", "rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(retry_after)})


def route_of(request: Request) -> str:
    """The matched route's template (never the raw path: metric labels must stay few)."""
    route = request.scope.get("route")
    return str(getattr(route, "path", "unmatched"))


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        # the most telling error first: in a union the other members' type errors come before it
        telling = [x for kind in ("value_error", "string_unicode") for x in errs if x.get("type") == kind]
        first = (telling or errs or [{}])[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a parameter
            loc = []
            msg = f"The request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')}); " \
                  "send a JSON object."
        else:
            where = ".".join(loc) or "body"
            msg = f"Invalid value for '{where}': {first.get('msg', 'invalid')}."
            if len(errs) > 1:
                msg += f" ({len(errs) - 1} more problem{'s' if len(errs) > 2 else ''} in the request.)"
        return JSONResponse(error_body(msg, "invalid_request_error", ".".join(loc) or None, first.get("type")), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        detail = str(e.detail)
        if e.status_code == 400 and detail == "There was an error parsing the body":  # FastAPI's words
            detail = not_utf8(await request.body()) or detail
        return JSONResponse(error_body(detail, kind), e.status_code, headers=getattr(e, "headers", None))


def not_utf8(body: bytes) -> str | None:
    """What is wrong with a body that is not UTF-8, and where; None if it is."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return (f"The request body is not UTF-8: byte 0x{body[e.start]:02x} at offset {e.start} ({e.reason}); "
                "send JSON encoded in UTF-8.")
    return None
