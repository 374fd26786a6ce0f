"""Run `kvfuse serve` as a child process on a free loopback port (for load tests, end-to-end tests and
`kvfuse cluster up`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(proc: subprocess.Popen[bytes], url: str, startup_s: float, what: str = "kvfuse serve",
                 path: str = "/health") -> None:
    """Wait until GET url+path answers 200; RuntimeError if the process exits first or time runs out."""
    import httpx

    deadline = time.monotonic() + startup_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not healthy on {url} within {startup_s:.0f} s")
        time.sleep(0.25)


def start_serve(args: Sequence[str], port: int, log: int | None = None) -> subprocess.Popen[bytes]:
    """Start `kvfuse serve ARGS --port PORT` (not waiting for it)."""
    return subprocess.Popen([sys.executable, "-m", "kvfuse", "serve", "--port", str(port), *args],
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, stdout=log, stderr=log)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Terminate a child, killing it if it has not exited after grace_s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def serve_process(args: Sequence[str], startup_s: float = 300.0) -> Iterator[str]:
    """Start `kvfuse serve ARGS --port P` and yield its base URL once /health answers 200.

    Raises RuntimeError if the process exits or is not healthy within startup_s (model loading takes
    seconds); the process is terminated on exit either way."""
    port = free_port()
    proc = start_serve(args, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, startup_s)
        yield url
    finally:
        stop(proc)
