"""Fidelity against cost of the registered fusers, on real MuSiQue passages (issue G's probe protocol).

    .venv/bin/python benchmarks/fuser_fidelity.py [--model smollm2-135m-instruct] [--cases 10] [--passages 6]

For each case the chunk caches are precomputed behind BOS and held in memory; full prefill is the
reference. Per method: mean KL(full || method) of the next-token distribution after the prompt, the
first-token agreement, the recomputed share of the chunk tokens, and the TTFT ratio to full (the
engine's own TTFT, median of the per-case ratios; methods run back to back within a case).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from kvfuse import fuse
from kvfuse.engine import Engine, Mode
from kvfuse.metrics import kl_divergence
from kvfuse.sampling import SamplingParams
from kvfuse.text import Tokenizer
from kvfuse.weights import resolve_model_path

sys.path.insert(0, str(Path(__file__).parent))
from common import musique_cases, musique_prompt  # noqa: E402

METHODS: dict[str, tuple[Mode, float | None]] = {
    "reuse": ("reuse", None),
    "blend@0.15": ("blend", 0.15),
    "blend@0.3": ("blend", 0.3),
    "queryaware@0.15": ("queryaware", 0.15),
    "queryaware@0.3": ("queryaware", 0.3),
    "queryaware-global@0.15": (fuse.QueryAware(layers="global"), 0.15),
    "queryaware-global@0.3": (fuse.QueryAware(layers="global"), 0.3),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--cases", type=int, default=10)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--passages", type=int, default=6)
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    engine, tok = Engine.load(path), Tokenizer(path)
    one = SamplingParams(max_tokens=1)
    kls: dict[str, list[float]] = {k: [] for k in METHODS}
    agree = dict.fromkeys(METHODS, 0)
    ratio: dict[str, list[float]] = {k: [] for k in METHODS}
    share: dict[str, list[float]] = {k: [] for k in METHODS}
    cases = musique_cases()[args.offset : args.offset + args.cases]
    for case in cases:
        req = musique_prompt(case, args.passages).request(tok)
        engine.precompute(req, "blend")
        engine.generate(req, "reuse", params=one)  # warm
        full = engine.generate(req, "full", params=one)
        for name, (mode, r) in METHODS.items():
            g = engine.generate(req, mode, r, params=one)
            kls[name].append(kl_divergence(full.first_logits, g.first_logits))
            agree[name] += int(int(g.first_logits.argmax()) == int(full.first_logits.argmax()))
            ratio[name].append(g.ttft_s / full.ttft_s)
            share[name].append(g.counts.recomputed / max(1, g.counts.reused))
    print(f"{Path(path).name}: {len(cases)} MuSiQue cases (from {args.offset}), {args.passages} passages each, "
          f"chunks behind BOS\n")
    print("| method | mean KL(full‖method) | median KL | first-token agreement | recomputed share | TTFT / full |")
    print("|---|---|---|---|---|---|")
    for name in METHODS:
        print(f"| {name} | {statistics.mean(kls[name]):.4f} | {statistics.median(kls[name]):.4f} | "
              f"{agree[name]}/{len(cases)} | {statistics.mean(share[name]):.3f} | "
              f"{statistics.median(ratio[name]):.3f} |")
    gap = statistics.mean(kls["reuse"])
    if gap > 0:
        print("\nshare of the reuse-to-full KL gap closed: " + ", ".join(
            f"{n} {1 - statistics.mean(kls[n]) / gap:.0%}" for n in METHODS if n != "reuse"))


if __name__ == "__main__":
    main()
