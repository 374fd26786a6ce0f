"""Fidelity against cost of the registered fusers, on real MuSiQue passages (issue G's probe protocol).

    .venv/bin/python benchmarks/fuser_fidelity.py [--model smollm2-135m-instruct] [--cases 10] [--passages 6]
        [--methods reuse,blend@0.15,queryaware@0.25:behind=self,...] [--rounds 5]

For each case every method's chunk caches are precomputed (behind the preamble its `behind` option
names) and held in memory; full prefill is the reference. Per method: mean KL(full || method) of the
next-token distribution after the prompt, the first-token agreement, the recomputed share of the
chunk tokens, and the TTFT ratio to full (the engine's own TTFT; per case, the median over `--rounds`
interleaved rounds of full and every method, then the median of the per-case ratios).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from kvfuse import fuse
from kvfuse.checkpoints import resolve_model_path
from kvfuse.engine import Engine
from kvfuse.engine.sampling import SamplingParams
from kvfuse.metrics import kl_divergence
from kvfuse.text import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from common import musique_cases, musique_prompt  # noqa: E402

METHODS = ("reuse,blend@0.15,blend@0.3,queryaware@0.15:behind=bos,queryaware@0.25:behind=bos,"
           "queryaware@0.25:layers=all:behind=bos,queryaware@0.25:wide=0.4:behind=bos,reuse:behind=head,"
           "queryaware@0.25:behind=head,reuse:behind=previous,queryaware@0.25:behind=previous,reuse:behind=self,"
           "queryaware@0.15:behind=self,queryaware@0.2:behind=self,queryaware@0.25:behind=self")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--cases", type=int, default=10)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--methods", default=METHODS, help="comma-separated fuser specs")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds per case (median)")
    args = ap.parse_args()
    methods = {spec: fuse.parse_spec(spec) for spec in args.methods.split(",") if spec}
    path = resolve_model_path(args.model)
    engine, tok = Engine.load(path), Tokenizer(path)
    one = SamplingParams(max_tokens=1)
    kls: dict[str, list[float]] = {k: [] for k in methods}
    agree = dict.fromkeys(methods, 0)
    ratio: dict[str, list[float]] = {k: [] for k in methods}
    share: dict[str, list[float]] = {k: [] for k in methods}
    cases = musique_cases()[args.offset : args.offset + args.cases]
    for case in cases:
        req = musique_prompt(case, args.passages).request(tok)
        for mode, _ in methods.values():
            engine.precompute(req, mode)
        engine.generate(req, "reuse", params=one)  # warm
        times: dict[str, list[float]] = {k: [] for k in ("full", *methods)}
        for _ in range(max(1, args.rounds)):
            full = engine.generate(req, "full", params=one)
            times["full"].append(full.ttft_s)
            for name, (mode, r) in methods.items():
                g = engine.generate(req, mode, r, params=one)
                times[name].append(g.ttft_s)
        for name, (mode, r) in methods.items():  # fidelity from the last round (every round is the same)
            g = engine.generate(req, mode, r, params=one)
            kls[name].append(kl_divergence(full.first_logits, g.first_logits))
            agree[name] += int(int(g.first_logits.argmax()) == int(full.first_logits.argmax()))
            ratio[name].append(statistics.median(times[name]) / statistics.median(times["full"]))
            share[name].append(g.counts.recomputed / max(1, g.counts.reused))
    print(f"{Path(path).name}: {len(cases)} MuSiQue cases (from {args.offset}), {args.passages} passages each, "
          f"chunk caches precomputed, {max(1, args.rounds)} timing rounds\n")
    print("| method | mean KL(full‖method) | median KL | first-token agreement | recomputed share | TTFT / full |")
    print("|---|---|---|---|---|---|")
    for name in methods:
        print(f"| {name} | {statistics.mean(kls[name]):.4f} | {statistics.median(kls[name]):.4f} | "
              f"{agree[name]}/{len(cases)} | {statistics.mean(share[name]):.3f} | "
              f"{statistics.median(ratio[name]):.3f} |")
    gap = statistics.mean(kls["reuse"]) if "reuse" in kls else 0.0
    if gap > 0:
        print("\nshare of the reuse-to-full KL gap closed: " + ", ".join(
            f"{n} {1 - statistics.mean(kls[n]) / gap:.0%}" for n in methods if n != "reuse"))


if __name__ == "__main__":
    main()
