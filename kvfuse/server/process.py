"""Run `kvfuse serve` as a child process on a free loopback port (for load tests and end-to-end tests)."""

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


@contextmanager
def serve_process(args: Sequence[str], startup_s: float = 300.0) -> Iterator[str]:
    """Start `kvfuse serve ARGS --port P` and yield its base URL once /health answers 200.

    Raises RuntimeError if the process exits or is not healthy within startup_s (model loading takes
    seconds); the process is terminated on exit either way."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvfuse", "serve", "--port", str(port), *args],
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvfuse serve exited with status {proc.returncode} before it was healthy")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvfuse serve was not healthy on {url} within {startup_s:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
