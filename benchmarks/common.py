"""Shared by the benchmark scripts: the MuSiQue prompt and interleaved timing."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MUSIQUE = Path(__file__).resolve().parents[1] / "data" / "musique_dev.json"  # in the repository (data/README.md)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), written next to every figure."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
                platform.processor())


def musique_cases() -> list[dict[str, Any]]:
    return json.loads(MUSIQUE.read_text())


def musique_prompt(case: dict[str, Any], n_passages: int):  # type: ignore[no-untyped-def]
    from kvfuse.text import Prompt

    return Prompt(chunks=tuple(c["text"] for c in case["ctxs"][:n_passages]), question=case["question"])


def interleaved(methods: dict[str, Callable[[], float]], runs: int) -> dict[str, list[float]]:
    """Warm each method up, then run one of each per round; returns every method's seconds by round."""
    for f in methods.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in methods}
    for r in range(runs):
        for name, f in methods.items():
            times[name].append(f())
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in times.items()}


def median_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of num/den, each pair measured back to back: robust to the machine's drift,
    which on these shared machines can shift every timing by 30% between rounds."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def timed(fn: Callable[[], object], n: int) -> float:
    """Median seconds of n calls."""
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)
