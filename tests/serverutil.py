"""Start a kvfuse app on a real loopback socket in a background thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvfuse.server.process import free_port


@contextmanager
def serving(app: Any) -> Iterator[str]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def samples(exposition: str, name: str) -> dict[str, float]:
    """The samples of one metric in Prometheus' text format, keyed by their labels ("k=v,k=v", sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(exposition):
        for s in fam.samples:
            if s.name == name:
                out[",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out
