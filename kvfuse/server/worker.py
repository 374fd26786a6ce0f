"""One model, one worker thread, a bounded queue.

Requests are jobs run one at a time on the worker thread, in arrival order, so parallel requests get
exactly the answers they would get one by one. A job emits events to its asyncio queue; setting its
cancel event (the client went away) stops it at the next token, or before it starts."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

Emit = Callable[[str, Any], None]
JobFn = Callable[[threading.Event, Emit], Any]


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__("the server is busy")
        self.retry_after = retry_after


class Job:
    def __init__(self, fn: JobFn, loop: asyncio.AbstractEventLoop) -> None:
        self.fn, self.loop = fn, loop
        self.cancel = threading.Event()
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def emit(self, kind: str, value: Any = None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    async def stream(self) -> AsyncIterator[tuple[str, Any]]:
        """Events until the job ends: ("delta", ...)* then ("done", result) or ("error", exception)."""
        while True:
            kind, value = await self.events.get()
            yield kind, value
            if kind in ("done", "error"):
                return


class Worker:
    def __init__(self, max_queue: int = 16) -> None:
        if max_queue < 1:
            raise ValueError("the queue needs room for at least one request")
        self.max_queue = max_queue
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._depth = 0
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=20)
        self._thread = threading.Thread(target=self._run, name="kvfuse-model", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def depth(self) -> int:
        """Requests waiting or running."""
        return self._depth

    def retry_after(self) -> int:
        per_job = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return max(1, round(per_job * self._depth))

    def submit(self, fn: JobFn) -> Job:
        job = Job(fn, asyncio.get_running_loop())
        with self._lock:
            if self._depth >= self.max_queue:
                raise QueueFull(self.retry_after())
            self._depth += 1
        self._q.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                if job.cancel.is_set():
                    job.emit("error", asyncio.CancelledError())
                else:
                    job.emit("done", job.fn(job.cancel, job.emit))
            except BaseException as e:  # reported to the request; the worker keeps serving
                try:
                    job.emit("error", e)
                except RuntimeError:  # the request's event loop is gone: nobody is waiting
                    pass
            finally:
                with self._lock:
                    self._depth -= 1
                self._recent.append(time.perf_counter() - t0)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)
