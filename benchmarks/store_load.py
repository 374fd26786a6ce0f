"""Issue B benchmark: blend TTFT with chunk caches in memory, on disk (pipelined and sequential loading)
and recomputed from scratch, and what the storage dtype costs and saves. Medians, one run, side by side.

    .venv/bin/python benchmarks/store_load.py [--runs 5] [--passages 6]

Disk runs start from a cold page cache for the store's files (posix_fadvise DONTNEED) and an empty memory
tier, so every chunk layer really comes off the disk. `load only` reads every layer of every chunk, as
the loader does, with no compute; `recompute only` is blend with the chunks already in memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median_ratio, medians, musique_cases, musique_prompt  # noqa: E402

from kvfuse.checkpoints import resolve_model_path  # noqa: E402
from kvfuse.engine import Engine  # noqa: E402
from kvfuse.engine.sampling import SamplingParams  # noqa: E402
from kvfuse.metrics import kl_divergence  # noqa: E402
from kvfuse.store import open_store  # noqa: E402
from kvfuse.text import Tokenizer  # noqa: E402
from kvfuse.weights import load_model  # noqa: E402

ONE = SamplingParams(max_tokens=1)


def drop_page_cache(root: Path) -> None:
    for f in root.glob("*/*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--skip-dtypes", action="store_true", help="only the loading comparison")
    args = ap.parse_args()
    path = resolve_model_path(None)
    lm = load_model(path)
    tok = Tokenizer(path)
    req = musique_prompt(musique_cases()[0], args.passages).request(tok)
    tmp = Path(tempfile.mkdtemp(prefix="kvfuse-bench-"))
    engine = Engine(lm.model, lm.fingerprint, store=open_store(tmp / "fp32", lm.fingerprint))
    engine.precompute(req, "blend")
    engine.store.flush()
    stored = sum(f.stat().st_size for f in tmp.rglob("*.safetensors"))
    print(f"prompt: {len(req)} tokens; store files: {stored >> 20} MiB")

    def memory() -> float:
        return engine.generate(req, "blend", 0.15, ONE).ttft_s

    def disk(pipelined: bool) -> float:
        e = Engine(lm.model, lm.fingerprint, store=open_store(tmp / "fp32", lm.fingerprint), self_check=False)
        e.pipelined = pipelined
        drop_page_cache(tmp / "fp32")
        return e.generate(req, "blend", 0.15, ONE).ttft_s

    def scratch() -> float:
        e = Engine(lm.model, lm.fingerprint, self_check=False)  # empty memory store, no disk
        return e.generate(req, "blend", 0.15, ONE).ttft_s

    def load_only() -> float:
        store = open_store(tmp / "fp32", lm.fingerprint)
        drop_page_cache(tmp / "fp32")
        t0 = time.perf_counter()
        entries = [store.open(engine.cache.chunk_key(c)) for c in req.chunks]
        for i in range(lm.model.cfg.num_layers):
            for e in entries:
                assert e is not None
                e.layer(i)
        return time.perf_counter() - t0

    methods = {"memory (recompute only)": memory, "disk, pipelined": lambda: disk(True),
               "disk, sequential": lambda: disk(False), "load only (disk)": load_only,
               "recomputed from scratch": scratch}
    times = interleaved(methods, args.runs)
    med = medians(times)
    mem = times["memory (recompute only)"]
    print("\n| blend@0.15, chunk caches | TTFT median (s) | median of per-round ratios to memory |")
    print("|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} | {median_ratio(times[k], mem):.2f}x |")
    bound = [max(a, b) for a, b in zip(times["load only (disk)"], mem, strict=True)]
    ratio = median_ratio(times["disk, pipelined"], bound)
    seq = median_ratio(times["disk, sequential"], bound)
    print(f"\n{'PASS' if ratio <= 1.1 else 'FAIL'}: pipelined / max(load, recompute) = {ratio:.3f} (median over "
          f"rounds; goal <= 1.10); sequential / max(load, recompute) = {seq:.3f}")

    if args.skip_dtypes:
        return
    print("\n| storage dtype | bytes per token | blend TTFT median (s), from disk | KL(full‖blend) "
          "| first token = full |")
    print("|---|---|---|---|---|")
    full = engine.prefill(req, "full").fused.logits
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        root = tmp / name
        e = Engine(lm.model, lm.fingerprint, store=open_store(root, lm.fingerprint), kv_dtype=dtype,
                   self_check=False)
        e.precompute(req, "blend")
        e.store.flush()
        per_token = e.cache.chunk_cache(req.chunks[0])[0].nbytes / len(req.chunks[0])
        ts = []
        for _ in range(args.runs):
            fresh = Engine(lm.model, lm.fingerprint, store=open_store(root, lm.fingerprint), kv_dtype=dtype,
                           self_check=False)
            drop_page_cache(root)
            ts.append(fresh.generate(req, "blend", 0.15, ONE).ttft_s)
        logits = e.prefill(req, "blend", 0.15).fused.logits
        print(f"| {name} | {per_token:.0f} | {statistics.median(ts):.3f} | {kl_divergence(full, logits):.5f} | "
              f"{bool(logits.argmax() == full.argmax())} |")


if __name__ == "__main__":
    main()
