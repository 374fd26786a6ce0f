"""The TTFT cost of computing a prefill in slices (issue H, item 3), on one machine, in one run.

    .venv/bin/python benchmarks/prefill_slices.py [--rounds 5] [--passages 6] [--model M] [--slices 256,512]

A full prefill of MuSiQue dev case 0 (6 passages) with each layer computed in one piece (the engine
before slicing) against PREFILL_SLICE-token slices (`kvfuse.fuse.core`), interleaved, one of each per
round; medians and the median of per-round ratios to one piece. No pause runs here: this is the cost of
the slices alone. Also reports the first-token logits' largest difference to one piece.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median_ratio, medians, musique_cases, musique_prompt  # noqa: E402

import kvfuse.fuse.core as core  # noqa: E402
from kvfuse.checkpoints import resolve_model_path  # noqa: E402
from kvfuse.engine import Engine  # noqa: E402
from kvfuse.engine.sampling import SamplingParams  # noqa: E402
from kvfuse.text import Tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--model", default=None)
    ap.add_argument("--slices", default="256,512")
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = resolve_model_path(args.model)
    engine = Engine.load(path)
    req = musique_prompt(musique_cases()[0], args.passages).request(Tokenizer(path))
    one = SamplingParams(max_tokens=1)
    sizes = {"one piece": 1 << 30, **{f"slices of {n}": int(n) for n in args.slices.split(",")}}
    logits: dict[str, torch.Tensor] = {}

    def run(name: str, size: int) -> float:
        core.PREFILL_SLICE = size
        g = engine.generate(req, "full", params=one)
        logits[name] = g.first_logits
        return g.ttft_s

    times = interleaved({name: (lambda n=name, s=size: run(n, s)) for name, size in sizes.items()}, args.rounds)
    med = medians(times)
    print(f"machine: {platform.machine()} {platform.processor()}, torch {torch.__version__}, 2 threads; prompt "
          f"{len(req)} tokens; {args.rounds} interleaved rounds\n")
    print("| prefill | TTFT (s) | / one piece | first-token logits, max diff to one piece |")
    print("|---|---|---|---|")
    for name in sizes:
        diff = float((logits[name] - logits["one piece"]).abs().max())
        print(f"| {name} | {med[name]:.3f} | {median_ratio(times[name], times['one piece']):.3f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
