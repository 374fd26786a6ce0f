"""Running work on the model worker from a route: a barrier job (edits, cold builds) awaited to its
result, and 429 when the queue is full."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvfuse.server.errors import as_api_error, busy
from kvfuse.server.state import ServerState
from kvfuse.server.worker import QueueFull


async def on_worker(state: ServerState, fn: Callable[[], Any]) -> Any:
    """Run fn on the worker as a barrier job (no request runs beside it) and return its result."""
    try:
        job = state.worker.submit(lambda cancel, emit: fn(), barrier=True)
    except QueueFull as e:
        raise busy(e.retry_after) from None
    async for kind, value in job.stream():
        if kind == "done":
            return value
        if kind == "error":
            raise as_api_error(value)
    return None
