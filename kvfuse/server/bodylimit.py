"""A request body limit, checked before anything parses the body: a declared Content-Length over the
limit gets its 413 at once, unread; a chunked body is read up to the limit and no further. The body
read is then handed to the app as it came."""

from __future__ import annotations

import json
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]


class BodyLimit:
    """ASGI middleware: HTTP request bodies of at most `max_bytes` reach `app`; larger ones get 413."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, send, int(declared))
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending it all
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await self._refuse(scope, send, None)
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Any, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else f"more than {self.max_bytes} bytes"
        msg = (f"The request body is {size}; this server takes at most {self.max_bytes} bytes (kvfuse serve "
               "--max-body-bytes). Send fewer or shorter documents or messages.")
        payload = json.dumps({"error": {"message": msg, "type": "invalid_request_error", "param": None,
                                        "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})
