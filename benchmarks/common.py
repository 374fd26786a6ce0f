"""Shared by the benchmark scripts: the MuSiQue prompt and interleaved timing."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

MUSIQUE = Path(__file__).resolve().parents[2] / "shared" / "data" / "musique_dev.json"


def musique_cases() -> list[dict[str, Any]]:
    return json.loads(MUSIQUE.read_text())


def musique_prompt(case: dict[str, Any], n_passages: int):  # type: ignore[no-untyped-def]
    from kvfuse.text import Prompt

    return Prompt(chunks=tuple(c["text"] for c in case["ctxs"][:n_passages]), question=case["question"])


def interleaved_medians(methods: dict[str, Callable[[], float]], runs: int) -> dict[str, float]:
    """Warm each method up, then run one of each per round and return each method's median seconds."""
    for f in methods.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in methods}
    for r in range(runs):
        for name, f in methods.items():
            times[name].append(f())
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
    return {k: statistics.median(v) for k, v in times.items()}
