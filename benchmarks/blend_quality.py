"""How close blend gets to full prefill, against ratio, schedule and token choice, on real MuSiQue passages.

    .venv/bin/python benchmarks/blend_quality.py [--cases 10] [--passages 6]

For each case: full prefill's next-token distribution is the reference; we report the mean and median
KL(full || method) and the first-token agreement, for reuse, blend at several ratios and filtering
schedules, and an ablation that picks the recomputed tokens at random (same schedule).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from kvfuse import fuse
from kvfuse.checkpoints import resolve_model_path
from kvfuse.engine import Engine
from kvfuse.metrics import kl_divergence
from kvfuse.text import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from common import musique_cases, musique_prompt  # noqa: E402

kl = kl_divergence


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=10)
    ap.add_argument("--passages", type=int, default=6)
    args = ap.parse_args()
    path = resolve_model_path(None)
    engine, tok = Engine.load(path), Tokenizer(path)
    cases = musique_cases()[: args.cases]
    hkvd = fuse.kv_deviation
    gen = torch.Generator().manual_seed(0)

    def random_dev(k: torch.Tensor, v: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor:
        return torch.rand(k.shape[1], generator=gen)

    variants = {
        "reuse": None,
        "blend r=0.05 m=2": (0.05, 2, hkvd),
        "blend r=0.15 m=1": (0.15, 1, hkvd),
        "blend r=0.15 m=2 (default)": (0.15, 2, hkvd),
        "blend r=0.15 m=4": (0.15, 4, hkvd),
        "random r=0.15 m=2 (ablation)": (0.15, 2, random_dev),
        "blend r=0.30 m=2": (0.30, 2, hkvd),
        "blend r=0.50 m=2": (0.50, 2, hkvd),
        "blend r=1.00": (1.0, 2, hkvd),
    }
    kls: dict[str, list[float]] = {k: [] for k in variants}
    agree = dict.fromkeys(variants, 0)
    with torch.inference_mode():
        for case in cases:
            req = musique_prompt(case, args.passages).request(tok)
            full = engine.prefill(req, "full").fused.logits
            caches = [engine.cache.chunk_cache(c)[0] for c in req.chunks]
            ids = [torch.tensor(c) for c in req.chunks]
            prefix = fuse.prefill(engine.model, torch.tensor(req.prefix)).cache
            suffix = torch.tensor(req.suffix)
            layout = fuse.FuseLayout.of(prefix, caches, suffix, ids)
            for name, spec in variants.items():
                if spec is None:
                    out = fuse.reuse(engine.model, layout).logits
                else:
                    ratio, m, dev = spec
                    out = fuse.blend(engine.model, layout, ratio, filter_layers=m, deviation=dev).logits
                kls[name].append(kl(full, out))
                agree[name] += int(out.argmax() == full.argmax())
    print(f"{len(cases)} MuSiQue cases, {args.passages} passages each\n")
    print("| method | mean KL(full‖method) | median KL | first-token agreement |")
    print("|---|---|---|---|")
    for name in variants:
        print(f"| {name} | {statistics.mean(kls[name]):.4f} | {statistics.median(kls[name]):.4f} | "
              f"{agree[name]}/{len(cases)} |")


if __name__ == "__main__":
    main()
