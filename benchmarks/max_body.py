"""A maximal request body against a real `kvfuse serve` (issue K): while one client sends a body at the
server's limit, a second streams a completion and a third polls /health. Reports the stream's
inter-token gaps and /health's latency during the big body, against a round without it.

    .venv/bin/python benchmarks/max_body.py [--rounds 5] [--max-tokens 64]

The server runs the default model with its default limits (the body limit is sized from the window
and the document limits); each client is its own process, so none waits on another's GIL. The big
body is chat messages of varied text filling the limit: it is read, validated, tokenised (seconds)
and refused with a 400 for the window. Target: gaps and /health under 200 ms.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time

import httpx

from kvfuse.server.process import serve_process


def stream(url: str, max_tokens: int, start: float, end_q: mp.Queue) -> list[tuple[float, float]]:  # type: ignore[type-arg]
    """(time, gap) of each streamed chunk after the first."""
    out, last = [], None
    body = {"prompt": "The refund policy says", "max_tokens": max_tokens, "stream": True, "temperature": 0}
    with httpx.Client(timeout=600) as h, h.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                now = time.time()
                if last is not None:
                    out.append((now, now - last))
                last = now
    return out


def health(url: str, until: float) -> list[tuple[float, float]]:
    out = []
    with httpx.Client(timeout=60) as h:
        while time.time() < until:
            t0 = time.time()
            h.get(url + "/health")
            out.append((t0, time.time() - t0))
            time.sleep(0.02)
    return out


def big(url: str, limit: int, at: float) -> tuple[float, float, int]:
    words, i = [], 0
    while sum(len(w) + 1 for w in words) < 300_000:
        words.append(f"clause{i} of the refund policy")
        i += 1
    text = " ".join(words)
    n = max(1, (limit - 1000) // (len(text) + 40))
    body = json.dumps({"messages": [{"role": "user", "content": text}] * n, "max_tokens": 1})
    time.sleep(max(0.0, at - time.time()))
    t0 = time.time()
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=600)
    return t0, time.time(), r.status_code, len(body)  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    from kvfuse.server.state import Limits

    limit = Limits().body_limit(32768)  # the default model's window
    rows = []
    with tempfile.TemporaryDirectory() as store, serve_process(["--store", store, "--log-level", "warning"]) as url:
        httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=600)
        with mp.get_context("spawn").Pool(3) as pool:
            for rnd in range(args.rounds):
                for with_body in (False, True):
                    start = time.time()
                    s = pool.apply_async(stream, (url, args.max_tokens, start, None))
                    hp = pool.apply_async(health, (url, start + 6.0))
                    b = pool.apply_async(big, (url, limit, start + 1.5)) if with_body else None
                    gaps, polls = s.get(), hp.get()
                    if b is not None:
                        t0, t1, status, size = b.get()
                    else:
                        t0, t1, status, size = start + 1.5, start + 4.5, 0, 0
                    during = [g for t, g in gaps if t0 <= t <= t1 + 0.5]
                    hdur = [g for t, g in polls if t0 <= t <= t1]
                    rows.append({"round": rnd, "big_body": with_body, "body_bytes": size, "status": status,
                                 "body_s": round(t1 - t0, 3), "gap_max_s": round(max(during, default=0), 3),
                                 "gap_p50_s": round(statistics.median(during), 3) if during else None,
                                 "health_max_s": round(max(hdur, default=0), 3), "gaps": len(during),
                                 "polls": len(hdur)})
                    print(json.dumps(rows[-1]), flush=True)
    for flag in (False, True):
        sel = [r for r in rows if r["big_body"] == flag]
        print(json.dumps({"big_body": flag, "limit_bytes": limit,
                          "gap_max_median_s": statistics.median(r["gap_max_s"] for r in sel),
                          "gap_max_worst_s": max(r["gap_max_s"] for r in sel),
                          "health_max_median_s": statistics.median(r["health_max_s"] for r in sel),
                          "health_max_worst_s": max(r["health_max_s"] for r in sel),
                          "body_s_median": statistics.median(r["body_s"] for r in sel)}))


if __name__ == "__main__":
    main()
