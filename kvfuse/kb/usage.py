"""A knowledge base's state files beside the store: usage.json (cumulative token counts per group) and
one build record per group (and tenant). Written atomically, under an advisory lock, so several
processes (the CLI, a server) can share one store directory.

    <store>/kb/<NAME>/usage.json
    <store>/kb/<NAME>/<GROUP>[@<TENANT>].json
"""

from __future__ import annotations

import fcntl
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvfuse.jsonfile import read_json, write_json


def kb_state_dir(state_dir: Path, kb: str) -> Path:
    return state_dir / "kb" / kb


def usage_path(state_dir: Path, kb: str) -> Path:
    """The one place the usage file's path is spelled."""
    return kb_state_dir(state_dir, kb) / "usage.json"


def build_record_path(state_dir: Path, kb: str, group: str, tenant: str | None) -> Path:
    who = f"{group}@{tenant}" if tenant else group
    return kb_state_dir(state_dir, kb) / f"{who}.json"


HISTORY = 500  # requests whose cumulative cached share is kept per group


class Usage:
    """Cumulative prompt and cached tokens per group: in a state file, or in memory without a state dir."""

    def __init__(self, state_dir: Path | None, kb: str) -> None:
        self.path = usage_path(state_dir, kb) if state_dir is not None else None
        self._mem: dict[str, Any] = {}
        self._lock = threading.Lock()

    def add(self, group: str, prompt: int, cached: int, cost_units: float = 0.0) -> float:
        """Count a request (and its cost units); returns the group's cumulative cached-token share. The
        last HISTORY requests' (time, cumulative share) are kept, for the page's chart."""
        def add(usage: dict[str, Any]) -> float:
            g = usage.setdefault(group, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
            g["requests"] += 1
            g["prompt_tokens"] += prompt
            g["cached_tokens"] += cached
            g["cost_units"] = round(g.get("cost_units", 0.0) + cost_units, 3)
            share = g["cached_tokens"] / g["prompt_tokens"] if g["prompt_tokens"] else 0.0
            g["history"] = [*g.get("history", [])[-(HISTORY - 1):], [round(time.time(), 3), round(share, 4)]]
            return share  # type: ignore[no-any-return]

        if self.path is None:
            with self._lock:
                return add(self._mem)
        with self._lock, locked(self.path):  # threads of this process, then other processes
            usage = read_json(self.path)
            share = add(usage)
            write_json(self.path, usage)
            return share

    def read(self) -> dict[str, Any]:
        if self.path is None:
            with self._lock:
                return json.loads(json.dumps(self._mem))
        return read_json(self.path)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock beside path, so concurrent processes update it one at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


