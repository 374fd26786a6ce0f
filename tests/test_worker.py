"""The worker: plain jobs run alone, generating jobs step together, at most max_batch at a time."""

import asyncio
import threading
import time
from typing import Any

import pytest

from kvfuse.server.worker import Worker


class Counter:
    """A fake generating job: done after `steps` steps; `fail_at` makes its stepped() raise there."""

    def __init__(self, name: str, steps: int, log: list[str], fail_at: int | None = None) -> None:
        self.name, self.steps, self.log, self.fail_at = name, steps, log, fail_at
        self.decoding = self
        self.seen = 0
        self.finished = 0
        self.aborted = 0

    @property
    def done(self) -> bool:
        return self.seen >= self.steps

    def stepped(self) -> None:
        self.seen += 1
        if self.seen == self.fail_at:
            raise ValueError(f"{self.name} broke")

    def finish(self) -> Any:
        self.finished += 1
        self.log.append(f"end {self.name}")
        return (self.name, self.seen)

    def abort(self) -> None:
        self.aborted += 1


async def _collect(job: Any) -> tuple[str, Any]:
    async for kind, value in job.stream():
        if kind in ("done", "error"):
            return kind, value
    raise AssertionError("no end")


def _run(worker: Worker, jobs: list[Any], gate: threading.Event) -> list[tuple[str, Any]]:
    async def main() -> list[tuple[str, Any]]:
        worker.submit(lambda cancel, emit: gate.wait(10))  # holds the worker until all are queued
        submitted = [worker.submit(j) for j in jobs]
        gate.set()
        return list(await asyncio.gather(*(_collect(j) for j in submitted)))

    return asyncio.run(main())


def test_generating_jobs_step_together_up_to_max_batch() -> None:
    sizes: list[list[str]] = []
    log: list[str] = []
    worker = Worker(16, lambda batch: sizes.append([c.name for c in batch]), max_batch=3)
    counters = [Counter(f"c{i}", steps, log) for i, steps in enumerate([2, 4, 1, 3, 2])]
    try:
        out = _run(worker, [lambda cancel, emit, c=c: c for c in counters], threading.Event())
    finally:
        worker.close()
    assert out == [("done", (c.name, c.steps)) for c in counters]
    assert all(c.finished == 1 for c in counters)
    assert max(len(s) for s in sizes) == 3 and sizes[0] == ["c0", "c1", "c2"]
    assert sum(len(s) for s in sizes) == sum(c.steps for c in counters)  # one step per token, none wasted
    assert ["c3"] in sizes or any("c3" in s and "c1" in s for s in sizes)  # a freed place was refilled
    assert worker.depth == 0


def test_a_failing_request_or_step_fails_only_what_it_touches() -> None:
    broken_step = {"on": False}

    def advance(batch: list[Any]) -> None:
        if broken_step["on"]:
            raise RuntimeError("the step broke")

    worker = Worker(16, advance, max_batch=4)
    log: list[str] = []
    try:
        bad = Counter("bad", 5, log, fail_at=2)
        good = Counter("good", 3, log)

        def boom(cancel: Any, emit: Any) -> Any:
            raise KeyError("no such thing")

        out = _run(worker, [lambda c, e: bad, lambda c, e: good, boom], threading.Event())
        assert out[0][0] == "error" and "bad broke" in str(out[0][1]) and (bad.finished, bad.aborted) == (0, 1)
        assert out[1] == ("done", ("good", 3))
        assert out[2][0] == "error" and isinstance(out[2][1], KeyError)
        broken_step["on"] = True
        lost = [Counter("x", 3, log), Counter("y", 3, log)]
        out = _run(worker, [lambda c, e, k=k: k for k in lost], threading.Event())
        assert [k for k, _ in out] == ["error", "error"] and all((k.finished, k.aborted) == (0, 1) for k in lost)
        broken_step["on"] = False
        assert _run(worker, [lambda c, e: Counter("after", 2, log)], threading.Event()) == [("done", ("after", 2))]
        assert worker.alive and worker.depth == 0
    finally:
        worker.close()


def test_a_cancelled_request_leaves_at_the_next_step() -> None:
    worker = Worker(16, lambda batch: None, max_batch=2)
    long = Counter("long", 1000, [])
    cancels: list[threading.Event] = []

    def start(cancel: threading.Event, emit: Any) -> Counter:
        cancels.append(cancel)
        return long

    def stepped() -> None:
        Counter.stepped(long)
        if long.seen == 3:
            cancels[0].set()  # the client went away

    long.stepped = stepped  # type: ignore[method-assign]
    try:
        assert _run(worker, [start], threading.Event()) == [("done", ("long", 3))]
    finally:
        worker.close()


def test_a_barrier_job_waits_for_the_running_ones_and_holds_the_queue() -> None:
    log: list[str] = []
    worker = Worker(16, lambda batch: None, max_batch=4)

    async def main() -> list[tuple[str, Any]]:
        gate = threading.Event()
        worker.submit(lambda cancel, emit: gate.wait(10))
        jobs = [worker.submit(lambda c, e: Counter("a", 3, log)),
                worker.submit(lambda c, e: log.append("edit"), barrier=True),
                worker.submit(lambda c, e: Counter("b", 1, log))]
        gate.set()
        return list(await asyncio.gather(*(_collect(j) for j in jobs)))

    try:
        out = asyncio.run(main())
    finally:
        worker.close()
    assert [k for k, _ in out] == ["done"] * 3
    assert log == ["end a", "edit", "end b"]  # the edit ran alone, and what came after it waited for it


def test_shutdown_and_cancelled_jobs_end_with_an_error_event() -> None:
    worker = Worker(16, lambda batch: None, max_batch=2)
    endless = Counter("endless", 10**9, [])

    async def main() -> list[tuple[str, Any]]:
        cancelled = worker.submit(lambda c, e: Counter("never", 1, []))
        cancelled.cancel.set()  # before it started
        running = worker.submit(lambda c, e: endless)
        first = await _collect(cancelled)
        while endless.seen < 3:
            await asyncio.sleep(0.01)
        await asyncio.get_running_loop().run_in_executor(None, worker.close)
        return [first, await _collect(running)]

    out = asyncio.run(main())
    assert [k for k, _ in out] == ["error", "error"]
    assert all(isinstance(v, asyncio.CancelledError) for _, v in out)
    assert (endless.finished, endless.aborted) == (0, 1) and not worker.alive and worker.depth == 0


def test_a_starting_job_pauses_to_step_the_running_ones() -> None:
    """While a job starts (its prefill), its pauses step the running requests; one that finishes there
    is ended only after the start, and the newcomer then joins the batch."""
    log: list[str] = []
    batches: list[list[str]] = []
    def advance(batch: list[Any]) -> None:
        batches.append([c.name for c in batch])
        time.sleep(0.002)

    worker = Worker(16, advance, max_batch=4, max_itl_factor=1.0)
    runner, short = Counter("runner", 10_000, log), Counter("short", 10_000, log)
    seen_in_pause: list[int] = []

    def newcomer(cancel: Any, emit: Any) -> Any:
        for k in range(6):  # six pieces of a prefill, a pause after each
            if k == 1:
                short.steps = short.seen + 1  # short finishes in the next pause
            worker.pause()
            seen_in_pause.append(runner.seen)
        log.append("newcomer started")
        runner.steps = runner.seen + 3
        return Counter("new", 1, log)

    async def main() -> list[tuple[str, Any]]:
        jobs = [worker.submit(lambda c, e: runner), worker.submit(lambda c, e: short)]
        await asyncio.sleep(0.05)
        jobs.append(worker.submit(newcomer))
        return list(await asyncio.gather(*(_collect(j) for j in jobs)))

    try:
        out = asyncio.run(main())
    finally:
        worker.close()
    assert out[1][0] == "done" and out[2] == ("done", ("new", 1))
    assert ["runner", "new"] in batches  # the newcomer joined the running one
    assert seen_in_pause == sorted(seen_in_pause) and seen_in_pause[-1] - seen_in_pause[0] == 5  # a step per pause
    assert log.index("end short") > log.index("newcomer started")  # ended after the start, not inside a pause
    assert worker.pause() is None and worker.depth == 0  # off the worker thread, a pause does nothing


def test_pauses_step_only_after_the_usual_gap() -> None:
    """With max_itl_factor F, a pause steps only once the running ones have waited (F - 1) usual steps."""
    log: list[str] = []
    worker = Worker(16, lambda batch: time.sleep(0.02), max_batch=2, max_itl_factor=6.0)  # a step: 20 ms
    runner = Counter("runner", 10_000, log)
    steps: list[int] = []

    def newcomer(cancel: Any, emit: Any) -> Any:
        before = runner.seen
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.5:  # a 0.5 s prefill, pausing every millisecond
            worker.pause()
            time.sleep(0.001)
        steps.append(runner.seen - before)
        runner.steps = runner.seen + 1
        return None

    async def main() -> None:
        job = worker.submit(lambda c, e: runner)
        await asyncio.sleep(0.2)  # the runner sets its usual step time alone
        await _collect(worker.submit(newcomer))
        await _collect(job)

    try:
        asyncio.run(main())
    finally:
        worker.close()
    # a step every 5 x 20 ms + 20 ms = 120 ms at most: about 4 in 0.5 s; pausing every time would give ~24
    assert 2 <= steps[0] <= 6, steps


def test_retry_after_is_the_time_until_a_slot_frees() -> None:
    """Retry-After is the measured service time of the work ahead: about one job's time when the queue
    is full of 0.8 s jobs (a slot frees when the running one ends), not the time to drain the queue."""
    from kvfuse.server.worker import QueueFull

    worker = Worker(4, max_batch=1)

    async def main() -> tuple[int, float]:
        first = worker.submit(lambda c, e: time.sleep(0.8))
        await _collect(first)  # one job measured
        jobs = [worker.submit(lambda c, e: time.sleep(0.8)) for _ in range(4)]
        try:
            worker.submit(lambda c, e: None)
        except QueueFull as e:
            retry = e.retry_after
        else:
            raise AssertionError("the queue was not full")
        t0 = time.perf_counter()
        while True:  # poll until a slot frees: that is what Retry-After promises
            try:
                jobs.append(worker.submit(lambda c, e: None))
                break
            except QueueFull:
                await asyncio.sleep(0.02)
        waited = time.perf_counter() - t0
        await asyncio.gather(*(_collect(j) for j in jobs))
        return retry, waited

    try:
        retry, waited = asyncio.run(main())
    finally:
        worker.close()
    assert waited <= 1.2 and 1 <= retry <= 2  # draining the queue would take 3.2 s


def test_on_passing_thread_returns_from_a_thread_that_has_ended_and_raises_what_it_raised() -> None:
    from kvfuse.server.worker import on_passing_thread

    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 42

    assert on_passing_thread(work) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def refuse() -> int:
        raise SystemExit("kvfuse: bad flag")

    with pytest.raises(SystemExit, match="bad flag"):
        on_passing_thread(refuse)
