"""CAG on the Albarán knowledge base: build, reload in a second process, question TTFT against full prefill
of the same prompt, and what an edit recomputes.

    .venv/bin/python benchmarks/kb_cag.py [--rounds 5]

1. `kvfuse kb build` in a fresh process on an empty store (the cold build), then again in a second fresh
   process (which finds every block on disk and only loads them).
2. In one process, interleaved for --rounds rounds: a question answered from the cached prefix (CAG) and
   the same prompt prefilled from scratch; the ratio is the median of the per-round ratios.
3. An edit of the FAQ (the last, most volatile document) and of basic-terms (an early one), each followed
   by a rebuild: tokens recomputed and seconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvfuse.checkpoints import resolve_model_path
from kvfuse.engine import Engine, Request
from kvfuse.engine.sampling import SamplingParams
from kvfuse.kb import answer
from kvfuse.kb.base import KnowledgeBase
from kvfuse.kb.manifest import resolve_kb_dir
from kvfuse.text import Tokenizer

QUESTIONS = [
    "How many days does a Team plan customer have to ask for a refund on an annual renewal?",
    "How many seats does the Team plan include?",
    "What is the uptime commitment in the public SLA?",
]


def kb_build(kb: Path, store: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvfuse", "kb", "build", str(kb), "--store", str(store), "--quiet"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvfuse-kb-bench-"))
    kb_dir, store = tmp / "albaran", tmp / "store"
    shutil.copytree(resolve_kb_dir("albaran"), kb_dir)
    try:
        t0 = time.perf_counter()
        cold = kb_build(kb_dir, store)
        cold_wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm = kb_build(kb_dir, store)
        warm_wall = time.perf_counter() - t0
        print(f"cold build: {cold['build_s']:.2f} s ({cold['tokens_recomputed']} tokens computed, "
              f"{cold['bytes'] / 2**20:.0f} MiB; process wall {cold_wall:.1f} s)")
        print(f"second process: loaded={warm['loaded']} in {warm['build_s']:.2f} s "
              f"(= {warm['build_s'] / cold['build_s']:.3f} of the build; process wall {warm_wall:.1f} s)")

        path = resolve_model_path(None)
        engine, tok = Engine.load(path, store_dir=store), Tokenizer(path)
        kb = KnowledgeBase.open(kb_dir, engine, tok, state_dir=store)
        kb.build("support")
        one = SamplingParams(max_tokens=1)
        cag_t: list[float] = []
        full_t: list[float] = []
        for r in range(args.rounds + 1):  # round 0 warms up
            q = QUESTIONS[r % len(QUESTIONS)]
            prep = answer.prepare(kb, q, "support")
            cag = engine.generate(prep.request, "prefix", params=one)
            full = engine.generate(Request(suffix=prep.request.suffix, prefix=prep.request.prefix), "full",
                                   params=one)
            assert cag.tokens == full.tokens, "CAG must answer exactly like full prefill"
            if r:
                cag_t.append(cag.ttft_s)
                full_t.append(full.ttft_s)
                print(f"round {r}: cag {cag.ttft_s:.3f} s, full {full.ttft_s:.3f} s "
                      f"(prompt {cag.counts.prompt} tokens, {cag.counts.cached} cached)", flush=True)
        ratio = statistics.median(a / b for a, b in zip(cag_t, full_t, strict=True))
        print(f"question TTFT: cag {statistics.median(cag_t):.3f} s, full {statistics.median(full_t):.3f} s, "
              f"median ratio {ratio:.4f}")

        faq = kb_dir / "docs" / "faq-refunds.md"
        faq.write_text("Updated this week.\n" + faq.read_text())
        kb.reload()
        e1 = kb.build("support")
        first = kb_dir / "docs" / "basic-terms.md"
        first.write_text("Updated this week.\n" + first.read_text())
        kb.reload()
        e2 = kb.build("support")
        print(f"edit the FAQ: {e1.tokens_recomputed} of {e1.tokens_total} tokens recomputed in {e1.build_s:.2f} s")
        print(f"edit basic-terms (an early document): {e2.tokens_recomputed} of {e2.tokens_total} tokens recomputed in "
              f"{e2.build_s:.2f} s")
        print(json.dumps({"cold_build_s": cold["build_s"], "second_process_load_s": warm["build_s"],
                          "load_over_build": warm["build_s"] / cold["build_s"], "ttft_cag_s": statistics.median(cag_t),
                          "ttft_full_s": statistics.median(full_t), "ttft_ratio": ratio,
                          "edit_faq_recomputed": e1.tokens_recomputed, "edit_early_recomputed": e2.tokens_recomputed,
                          "tokens_total": e2.tokens_total}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
