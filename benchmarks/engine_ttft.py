"""Issue A benchmark: TTFT of full, prefix, reuse and blend against HF transformers, on one machine, in one run.

    .venv/bin/python benchmarks/engine_ttft.py [--runs 5] [--cases 10] [--passages 6]

Runs are interleaved (one of each method per round) and reported as medians, so drift in a noisy machine
hits every method alike. Peak RSS is measured in a fresh subprocess per mode: after the model is loaded
and the chunk caches are in the memory store, the kernel's peak-RSS counter is reset (clear_refs 5) and
read back (VmHWM) once the request's first token is out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median_ratio, medians, musique_cases  # noqa: E402
from common import musique_prompt as prompt_for  # noqa: E402

from kvfuse.metrics import kl_divergence  # noqa: E402


def load(n_passages: int):  # type: ignore[no-untyped-def]
    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.engine import Engine
    from kvfuse.text import Tokenizer

    path = resolve_model_path(None)
    return Engine.load(path), Tokenizer(path), path, musique_cases()


def ttft(engine, req, mode: str, ratio: float | None = None) -> float:  # type: ignore[no-untyped-def]
    from kvfuse.engine.sampling import SamplingParams

    return engine.generate(req, mode, ratio, SamplingParams(max_tokens=1)).ttft_s


def rss_child(mode: str, n_passages: int) -> None:
    """Print the peak RSS (bytes) of one request in `mode`, measured from a reset high-water mark."""
    engine, tok, _, cases = load(n_passages)
    p = prompt_for(cases[0], n_passages)
    req = p.request(tok, prefix_mode=mode == "prefix")
    engine.precompute(req, mode)
    ttft(engine, req, mode, 0.15 if mode == "blend" else None)  # warm up allocations of the same shapes
    baseline = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    fused = engine.prefill(req, mode, 0.15 if mode == "blend" else None).fused
    print(json.dumps({"peak": _status("VmHWM"), "baseline": baseline, "fused_bytes": fused.cache.nbytes}))


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cases", type=int, default=10, help="cases for first-token agreement")
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args.rss_child, args.passages)
        return

    from transformers import AutoModelForCausalLM

    engine, tok, path, cases = load(args.passages)
    p = prompt_for(cases[0], args.passages)
    req, req_prefix = p.request(tok), p.request(tok, prefix_mode=True)
    print(f"prompt: {len(req)} tokens ({args.passages} MuSiQue passages + question), torch threads "
          f"{torch.get_num_threads()}", flush=True)
    from kvfuse.checkpoints import gguf_of

    gguf = gguf_of(path)  # transformers reads the GGUF the checkpoint dir names (or its safetensors)
    where = {"gguf_file": gguf.name} if gguf is not None else {}
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent if gguf else path), dtype=torch.float32, **where).eval()
    ids = torch.tensor([req.ids])

    def hf_ttft() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            int(hf(ids, logits_to_keep=1).logits[0, -1].argmax())
        return time.perf_counter() - t0

    engine.precompute(req, "blend")
    engine.precompute(req_prefix, "prefix")
    methods = {
        "hf_full": hf_ttft,
        "full": lambda: ttft(engine, req, "full"),
        "prefix": lambda: ttft(engine, req_prefix, "prefix"),
        "reuse": lambda: ttft(engine, req, "reuse"),
        "blend@0.15": lambda: ttft(engine, req, "blend", 0.15),
    }
    times = interleaved(methods, args.runs)
    med = medians(times)

    agree = {"reuse": 0, "blend@0.15": 0}
    kl = {"reuse": [], "blend@0.15": []}
    for case in cases[: args.cases]:
        rq = prompt_for(case, args.passages).request(tok)
        full = engine.prefill(rq, "full").fused.logits
        engine.precompute(rq, "blend")
        for name, (mode, ratio) in {"reuse": ("reuse", None), "blend@0.15": ("blend", 0.15)}.items():
            got = engine.prefill(rq, mode, ratio).fused.logits
            agree[name] += int(got.argmax() == full.argmax())
            kl[name].append(kl_divergence(full, got))

    rss = {}
    for mode in ("full", "blend"):
        out = subprocess.run([sys.executable, __file__, "--rss-child", mode, "--passages", str(args.passages)],
                             capture_output=True, text=True, check=True)
        rss[mode] = json.loads(out.stdout.strip().splitlines()[-1])

    mib = 1 << 20
    print("\n## Results")
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, torch {torch.__version__}")
    print(f"prompt tokens: {len(req)}; runs: {args.runs} (medians)")
    print("| method | TTFT median (s) | vs kvfuse full | vs HF full |")
    print("|---|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} | {median_ratio(times[k], times['full']):.3f}x | "
              f"{median_ratio(times[k], times['hf_full']):.3f}x |")
    print("(ratios are medians of per-round ratios, each round's methods measured back to back)")
    print(f"\nfirst-token agreement with full over {args.cases} cases: "
          + ", ".join(f"{k} {agree[k]}/{args.cases} (mean KL {statistics.mean(kl[k]):.4f})" for k in agree))
    fb = rss["blend"]["fused_bytes"]
    full_peak, blend_peak = rss["full"]["peak"], rss["blend"]["peak"]
    print(f"peak RSS during the request: full {full_peak / mib:.0f} MiB, blend {blend_peak / mib:.0f} MiB; "
          f"blend - full = {(blend_peak - full_peak) / mib:.0f} MiB; fused cache {fb / mib:.0f} MiB")
    checks = {
        "blend@0.15 <= 0.30x full": median_ratio(times["blend@0.15"], times["full"]) <= 0.30,
        "full <= 1.1x HF full": median_ratio(times["full"], times["hf_full"]) <= 1.1,
        "prefix <= 0.05x full": median_ratio(times["prefix"], times["full"]) <= 0.05,
        "blend peak RSS <= full peak + fused cache": rss["blend"]["peak"] <= rss["full"]["peak"] + fb,
    }
    for k, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {k}")


if __name__ == "__main__":
    main()
