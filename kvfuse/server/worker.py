"""One model, one worker thread, a bounded queue, and decoding steps shared by the running requests.

Jobs start on the worker thread in arrival order. A plain job runs to its end there. A generating
job starts (its prefill and first token) and hands back a `Stepper`; the worker then moves every
running stepper on by one token per step, all of them in one `advance` call (the engine decodes them
as one batch), and starts queued jobs between steps while fewer than max_batch are running. A
barrier job (a knowledge-base edit) waits until none is running, and a request stores its prompt's
cache as soon as it has its first token, so a request reads the knowledge base and the store as it
would one by one; batching changes no answer (see kvfuse/engine/decode.py). So parallel requests get exactly
the answers they would get one by one. A job emits events to its asyncio queue; setting its cancel
event (the client went away) stops it at the next token, or before it starts.

A long prefill does not stall the running streams: a starting job calls `pause()` between the pieces
of its prefill (kvfuse.fuse.core: each layer, in slices of PREFILL_SLICE tokens), and there the worker
steps the running requests once whenever they have waited `(max_itl_factor - 1)` times a usual step
since their last one; so while a newcomer prefills, running streams get a token about every
`max_itl_factor` usual steps (plus at most one slice), and the newcomer gets the rest of the time.
Pausing changes nothing computed. A request that finishes during a pause is ended (its citations, which
may run the model) after the job that paused has started."""

from __future__ import annotations

import asyncio
import math
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

Emit = Callable[[str, Any], None]
JobFn = Callable[[threading.Event, Emit], Any]
T = TypeVar("T")


@runtime_checkable
class Stepper(Protocol):
    """A job that generates: `decoding` is what `advance` moves on; after each step the worker calls
    `stepped()` (take the new token; raise on this request's own failure), and once `done`,
    `finish()` (the job's result); on an error it calls `abort()` instead."""

    decoding: Any

    @property
    def done(self) -> bool: ...

    def stepped(self) -> None: ...

    def finish(self) -> Any: ...

    def abort(self) -> None: ...


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__("the server is busy")
        self.retry_after = retry_after


class Job:
    def __init__(self, fn: JobFn, loop: asyncio.AbstractEventLoop, barrier: bool = False) -> None:
        self.fn, self.loop = fn, loop
        self.barrier = barrier  # starts only when no other job is running (it changes what they read)
        self.cancel = threading.Event()
        self.started = time.perf_counter()  # reset when the worker starts it
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


def on_passing_thread(fn: Callable[[], T]) -> T:
    """fn() on a thread of its own that ends when fn returns (its exception re-raised here).

    torch's CPU kernels run on OpenMP, which gives every thread that starts parallel work a team of
    its own, kept while that thread lives. GNU OpenMP (torch's) lets a team's idle threads spin
    between parallel regions only while the process has no more such threads than cores; past that
    they sleep after each region and are woken for the next, thousands of times a prefill. A server
    that loaded its model on the main thread and then computed on its model thread had two teams on
    a 2-core machine: a RAG prompt's prefill took 0.98-1.03 s there against 0.82-0.84 s on one
    thread (7,000 sleeps a prefill against none; docs/benchmarks.md, stop 56). So the server loads
    on a thread that ends, whose team ends with it, and the model thread's is the only one left."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 -- handed to the caller, whatever it is
            err.append(e)

    t = threading.Thread(target=run, name="kvfuse-load", daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


DEFAULT_MAX_ITL_FACTOR = 1.5  # while a newcomer prefills, a running stream steps at least every 1.5 usual steps


class Worker:
    def __init__(self, max_queue: int = 16, advance: Callable[[list[Any]], None] | None = None,
                 max_batch: int = 1, max_itl_factor: float = DEFAULT_MAX_ITL_FACTOR) -> None:
        if max_queue < 1 or max_batch < 1:
            raise ValueError("the queue and the batch need room for at least one request")
        if max_itl_factor < 1.0:
            raise ValueError(f"max_itl_factor must be at least 1 (a step every usual step), got {max_itl_factor}")
        self.max_queue, self.max_batch, self.max_itl_factor = max_queue, max_batch, max_itl_factor
        self._advance = advance
        self._running: list[tuple[Job, Stepper]] = []  # only the worker thread touches these four
        self._ended: list[tuple[Job, Stepper]] = []  # finished during a pause: ended after the paused start
        self._starting = False
        self._last_step = 0.0
        self._step_s: deque[float] = deque(maxlen=16)  # recent steps' durations
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._depth = 0
        self._lock = threading.Lock()
        self._last_end: float | None = None
        self._recent: deque[float] = deque(maxlen=20)  # seconds between finished jobs
        self._thread = threading.Thread(target=self._run, name="kvfuse-model", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def depth(self) -> int:
        """Requests waiting or running."""
        return self._depth

    @property
    def running(self) -> int:
        """Requests decoding or starting now (read from another thread: a snapshot)."""
        return len(self._running) + int(self._starting)

    def retry_after(self) -> int:
        """Seconds until a full queue likely has room: the usual time between two finished jobs (the
        measured service time, batching included), less the time since the last one finished."""
        if not self._recent:
            return 1
        since = time.perf_counter() - (self._last_end or 0.0)
        return max(1, math.ceil(statistics.median(self._recent) - since))

    def submit(self, fn: JobFn, barrier: bool = False) -> Job:
        """Queue a job; a `barrier` job (a knowledge-base edit) waits until the running ones are done, so
        that every request reads the knowledge base as it was when it started."""
        job = Job(fn, asyncio.get_running_loop(), barrier)
        with self._lock:
            if self._depth >= self.max_queue:
                raise QueueFull(self.retry_after())
            self._depth += 1
        self._q.put(job)
        return job

    def _run(self) -> None:
        running = self._running
        held: Job | None = None  # a barrier job waiting for the running ones to finish
        while True:
            while len(running) < self.max_batch:  # start queued jobs before the next step
                job: Job | None
                if held is not None:
                    if running:
                        break
                    job, held = held, None
                else:
                    try:
                        job = self._q.get(block=not running)
                    except queue.Empty:
                        break
                if job is None:
                    for j, s in running:
                        self._end(j, s, "error", asyncio.CancelledError())
                    return
                if job.barrier and running:
                    held = job
                    break
                self._start(job)
            if running:
                self._step()

    def pause(self) -> None:
        """Called by a starting job between pieces of its prefill: step the running requests once if
        they have waited long enough (see the module docstring). Anywhere else it does nothing."""
        if not (self._starting and self._running) or threading.current_thread() is not self._thread:
            return
        usual = statistics.median(self._step_s) if self._step_s else 0.0
        if time.perf_counter() - self._last_step >= (self.max_itl_factor - 1.0) * usual:
            self._step(pausing=True)

    def _step(self, pausing: bool = False) -> None:
        """One decoding step of every running request; those that finish are ended (after the paused
        start, when pausing)."""
        running = self._running
        t0 = time.perf_counter()
        try:
            assert self._advance is not None
            self._advance([s.decoding for _, s in running])
        except BaseException as e:  # the step itself failed: every request in it fails; the worker goes on
            for j, s in running:
                self._end(j, s, "error", e)
            running.clear()
            return
        finally:
            self._last_step = time.perf_counter()
        self._step_s.append(self._last_step - t0)
        for j, s in list(running):
            try:
                s.stepped()
                if s.done or j.cancel.is_set():
                    running.remove((j, s))
                    if pausing:
                        self._ended.append((j, s))
                    else:
                        self._end(j, s, "done", None)
            except BaseException as e:  # this request's own failure
                running.remove((j, s))
                self._end(j, s, "error", e)

    def _start(self, job: Job) -> None:
        job.started = time.perf_counter()
        out = None
        self._starting = True
        try:
            if job.cancel.is_set():
                raise asyncio.CancelledError()
            out = job.fn(job.cancel, job.emit)
            if isinstance(out, Stepper) and not (out.done or job.cancel.is_set()):
                if self._advance is None:
                    raise RuntimeError("a generating job needs a worker with an advance function")
                self._running.append((job, out))
                return
            self._end(job, out if isinstance(out, Stepper) else None, "done", out)
        except BaseException as e:  # reported to the request; the worker keeps serving
            self._end(job, out if isinstance(out, Stepper) else None, "error", e)
        finally:
            self._starting = False
            ended, self._ended = self._ended, []
            for j, s in ended:
                self._end(j, s, "done", None)

    def _end(self, job: Job, stepper: Stepper | None, kind: str, value: Any) -> None:
        """Report a job's end: its stepper's result (kind "done"), or an error (the stepper is aborted)."""
        try:
            if stepper is not None:
                try:
                    if kind == "done":
                        value = stepper.finish()
                    else:
                        stepper.abort()
                except BaseException as e:
                    kind, value = "error", e
        finally:  # counted out before its client hears of the end
            with self._lock:
                self._depth -= 1
            now = time.perf_counter()  # the time since the worker last finished a job, while busy with this one
            self._recent.append(now - max(self._last_end or 0.0, job.started))
            self._last_end = now
        try:
            job.emit(kind, value)
        except RuntimeError:  # the request's event loop is gone: nobody is waiting
            pass

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)
