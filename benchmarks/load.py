"""Bounded load over loopback: N concurrent clients x M requests each, the same RAG requests sent as
`blend` (documents fused from their cached chunk caches) and as `full` (kvfuse.mode = full).

    .venv/bin/python benchmarks/load.py [--clients 4] [--requests 3] [--rounds 5] [--passages 6]
                                        [--max-tokens 8] [--stop '\n'] [--max-itl-factor F]

A `kvfuse serve` process is started on a free loopback port with the default model and a fresh store.
Each request carries a MuSiQue case's passages as `documents` and its question as the prompt; every
distinct request is sent once before timing (its chunk caches are computed on first sight, as the
server does). Per round, blend and full run back to back; TTFT is measured at the client (time to the
first streamed token, queueing included). Answers stop at a newline by default, as `kvfuse eval` stops
MuSiQue answers (`--stop ''` forces max-tokens tokens). Reports p50/p95 TTFT, requests per second, the
mean completion length, and the median over rounds of the blend/full throughput ratio.

Inter-token latency (ITL) is the gap between a stream's consecutive text chunks at the client. In every
round, before its blend and full runs, one request decodes max(32, max-tokens) tokens alone: the lone
step that the p50/p99 ITL under load are reported against is the median of those rounds' median gaps
between steps (one sample before the rounds varied by 145-265 ms on one host). A step that takes
several drafted tokens streams them as chunks well under a millisecond apart; those gaps are left out of
the lone step (`step_gaps`), and stay in the ITL under load, as a client sees them. `--max-itl-factor` is passed to
`kvfuse serve`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
STEP_GAP_S = 0.002  # chunks closer than this came from one decoding step (`step_gaps`)
from common import musique_cases  # noqa: E402

from kvfuse.server.process import serve_process  # noqa: E402


def one(url: str, body: dict) -> tuple[float, int, list[float]]:
    """(client TTFT, completion tokens, gaps in seconds between its text chunks) of one streamed completion."""
    t0 = time.perf_counter()
    ttft, n, last, gaps = None, 0, None, []
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=600) as h, h.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = int(chunk["usage"]["completion_tokens"])
            if any(c.get("text") for c in chunk.get("choices", [])):
                if last is not None:
                    gaps.append(now - last)
                last = now
    return (ttft if ttft is not None else float("nan")), n, gaps


def run(url: str, bodies: list[dict], clients: int, per_client: int
        ) -> tuple[list[float], float, list[int], list[float]]:
    """Every client sends per_client requests in turn; returns the TTFTs, requests per second, lengths and
    inter-token gaps."""
    def client(i: int) -> list[tuple[float, int, list[float]]]:
        return [one(url, bodies[(i * per_client + j) % len(bodies)]) for j in range(per_client)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = [x for xs in pool.map(client, range(clients)) for x in xs]
    rps = clients * per_client / (time.perf_counter() - t0)
    return [t for t, _, _ in done], rps, [n for _, n, _ in done], [g for _, _, gs in done for g in gs]


def step_gaps(gaps: list[float]) -> list[float]:
    """The gaps between a lone stream's decoding steps: a step that takes several tokens at once (drafts
    from the context) sends them as chunks well under a millisecond apart, which are no step's time."""
    steps = [g for g in gaps if g > STEP_GAP_S]
    return steps or gaps


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3, help="requests per client per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--stop", default="\n", help="stop string ('' for none: every answer is max-tokens long)")
    ap.add_argument("--max-itl-factor", type=float, default=None, help="passed to kvfuse serve")
    args = ap.parse_args()
    store = tempfile.mkdtemp(prefix="kvfuse-load-")
    args_serve = ["--store", store, "--max-queue", str(4 * args.clients), "--log-level", "warning"]
    if args.max_itl_factor is not None:
        args_serve += ["--max-itl-factor", str(args.max_itl_factor)]
    with serve_process(args_serve) as url:
        cases = musique_cases()[: args.clients * args.requests]
        blend = [{"prompt": f"Question: {c['question']}\nAnswer:", "max_tokens": args.max_tokens, "temperature": 0,
                  **({"stop": [args.stop]} if args.stop else {}),
                  "documents": [{"text": p["text"]} for p in c["ctxs"][: args.passages]]} for c in cases]
        full = [{**b, "kvfuse": {"mode": "full"}} for b in blend]
        for b in blend:  # chunk caches are computed on first sight; time the reuse
            one(url, b)
        lone_body = {**blend[0], "max_tokens": max(32, args.max_tokens)}
        lone_body.pop("stop", None)
        results: dict[str, list] = {"blend": [], "full": []}
        lone_steps = []
        for r in range(args.rounds):
            lone_steps.append(statistics.median(step_gaps(one(url, lone_body)[2])))
            print(f"round {r + 1}: a lone request's step {1000 * lone_steps[-1]:.1f} ms", flush=True)
            for name, bodies in (("blend", blend), ("full", full)):
                ttfts, rps, lengths, gaps = run(url, bodies, args.clients, args.requests)
                results[name].append((ttfts, rps, lengths, gaps))
                print(f"round {r + 1} {name}: p50 {pct(ttfts, 0.5):.2f} s, p95 {pct(ttfts, 0.95):.2f} s, "
                      f"{rps:.3f} req/s, ITL p99 {1000 * pct(gaps, 0.99) if gaps else float('nan'):.0f} ms",
                      flush=True)
        lone_step = statistics.median(lone_steps)
        summary: dict = {"lone_step_ms": 1000 * lone_step, "lone_step_ms_per_round": [1000 * x for x in lone_steps]}
        for name, rounds in results.items():
            all_ttft = [t for ts, _, _, _ in rounds for t in ts]
            all_gaps = [g for _, _, _, gs in rounds for g in gs]
            summary[name] = {"ttft_p50_s": pct(all_ttft, 0.5), "ttft_p95_s": pct(all_ttft, 0.95),
                             "rps_median": statistics.median(rps for _, rps, _, _ in rounds),
                             "completion_tokens_mean": statistics.mean(n for _, _, ns, _ in rounds for n in ns)}
            if all_gaps:
                summary[name] |= {"itl_p50_ms": 1000 * pct(all_gaps, 0.5), "itl_p99_ms": 1000 * pct(all_gaps, 0.99),
                                  "itl_p99_over_lone_step": pct(all_gaps, 0.99) / lone_step}
        ratio = statistics.median(b[1] / f[1] for b, f in zip(results["blend"], results["full"], strict=True))
        summary["throughput_ratio_blend_over_full"] = ratio
        summary["setup"] = {"clients": args.clients, "requests_per_client": args.requests, "rounds": args.rounds,
                            "passages": args.passages, "max_tokens": args.max_tokens, "stop": args.stop,
                            "max_itl_factor": args.max_itl_factor}
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
