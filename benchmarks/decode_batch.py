"""Batched decoding: the cost of a decoding step per request when 1, 2, 4 or 8 requests step together.

    .venv/bin/python benchmarks/decode_batch.py [--runs 5] [--passages 6] [--steps 8] [--sizes 1 2 4 8]

Eight MuSiQue prompts (chunk caches precomputed, then fused by plain reuse: decoding costs the same
whatever the prefill mode) each generate `--steps` greedy tokens, EOS ignored. Per round, for every
batch size b, b of them start (`Engine.begin`) and are stepped together (`Engine.advance`) to the end;
the time of the steps divided by b * (steps - 1) is the cost per request-step. "1 unpadded" is a lone
request stepped with one row, as before batching (its tokens are not compared: a one-row product sums
in another order; see kvfuse/engine/decode.py), to show what the padding row costs. Rounds are interleaved
and reported as medians. Every batched request's tokens must equal its tokens generated alone.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median_ratio, medians, musique_cases  # noqa: E402
from common import musique_prompt as prompt_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()

    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.engine import Engine, decode
    from kvfuse.engine.sampling import SamplingParams
    from kvfuse.text import Tokenizer

    path = resolve_model_path(None)
    engine, tok = Engine.load(path), Tokenizer(path)
    engine.greedy_head()
    limit = engine.decode_batch_limit()
    n = max(args.sizes)
    reqs = [prompt_for(c, args.passages).request(tok) for c in musique_cases()[:n]]
    for r in reqs:
        engine.precompute(r, "reuse")
    params = SamplingParams(max_tokens=args.steps, ignore_eos=True)
    print(f"prompts: {min(map(len, reqs))}-{max(map(len, reqs))} tokens; {args.steps} greedy tokens; batch limit "
          f"{limit}; torch threads {torch.get_num_threads()}", flush=True)
    alone = [engine.generate(r, "reuse", params=params).tokens for r in reqs]
    mismatches = 0

    def per_request_step(b: int, rows: int = decode.MIN_ROWS) -> float:
        nonlocal mismatches
        batch = [engine.begin(r, "reuse", None, params) for r in reqs[:b]]
        decode.MIN_ROWS = rows
        try:
            t0 = time.perf_counter()
            while not all(d.done for d in batch):
                engine.advance(batch)
            spent = time.perf_counter() - t0
        finally:
            decode.MIN_ROWS = padded
        tokens = [d.close().tokens for d in batch]
        if rows == padded:
            mismatches += sum(t != a for t, a in zip(tokens, alone, strict=False))
        return spent / (b * (args.steps - 1))

    padded = decode.MIN_ROWS
    methods = {"batch 1 unpadded": lambda: per_request_step(1, rows=1)}
    methods.update({f"batch {b}": (lambda b=b: per_request_step(b)) for b in args.sizes})
    times = interleaved(methods, args.runs)
    med = medians(times)
    base = "batch 1 unpadded"
    print("\n## Results")
    print(f"machine: {platform.machine()}, torch {torch.__version__}; runs: {args.runs} (medians)")
    print("| requests stepping together | per request-step (ms) | vs 1 unpadded |")
    print("|---|---|---|")
    for k, v in med.items():
        print(f"| {k.removeprefix('batch ')} | {v * 1e3:.1f} | {median_ratio(times[k], times[base]):.3f}x |")
    print(f"requests whose tokens differed from decoding alone: {mismatches}")
    if mismatches:
        raise SystemExit("batched decoding changed tokens")


if __name__ == "__main__":
    main()
