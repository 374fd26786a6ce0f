"""Precisions side by side: speed, memory and fidelity of fp32, bf16 and int8 (issue H, part 1).

    .venv/bin/python benchmarks/precision.py [--model M] [--rounds 5] [--steps 32] [--cases 50]
        [--precisions fp32,bf16,int8] [--skip-speed] [--skip-fidelity] [--skip-rss]

Speed, on MuSiQue dev case 0 (6 passages), one engine per precision, interleaved rounds (medians):
full prefill TTFT, a question on a cached prefix (`prefix` mode: everything but the question is
stored blocks) and ms per greedy decoding step (`--steps` tokens, EOS ignored; the total minus TTFT).
Memory: each precision's peak RSS after loading and one full prefill and decode, measured in a fresh
process (`--rss P`). Fidelity against fp32, on `--cases` dev cases: fp32's greedy answer of `--steps`
tokens is the reference; every other precision is teacher-forced on it, and the table gives the
first-token agreement, the token agreement and the mean KL(fp32 || precision) over those tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median_ratio, medians, musique_cases, musique_prompt  # noqa: E402


def _engines(model: str | None, precisions: list[str]):  # type: ignore[no-untyped-def]
    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.engine import Engine
    from kvfuse.text import Tokenizer

    path = resolve_model_path(model)
    tok = Tokenizer(path)  # first, as `runtime.open_engine` does: its parsing peak comes before the weights
    return {p: Engine.load(path, precision=p) for p in precisions}, tok


def rss(model: str | None, precision: str, steps: int) -> None:
    """In this process: load one precision, prefill and decode once, print the peak RSS in MiB."""
    from kvfuse.engine.sampling import SamplingParams

    engines, tok = _engines(model, [precision])
    req = musique_prompt(musique_cases()[0], 6).request(tok)
    engines[precision].generate(req, "full", params=SamplingParams(max_tokens=steps, ignore_eos=True))
    print(json.dumps({"precision": precision, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                      / 1024}))


def speed(engines, tok, rounds: int, steps: int) -> None:  # type: ignore[no-untyped-def]
    from kvfuse.engine.sampling import SamplingParams

    req = musique_prompt(musique_cases()[0], 6).request(tok)
    one, many = SamplingParams(max_tokens=1), SamplingParams(max_tokens=steps, ignore_eos=True)
    for e in engines.values():
        e.precompute(req, "prefix")
    fns = {}
    for p, e in engines.items():
        fns[f"{p} prefill"] = lambda e=e: e.generate(req, "full", params=one).ttft_s
        fns[f"{p} cached prefix"] = lambda e=e: e.generate(req, "prefix", params=one).ttft_s
        fns[f"{p} decode step"] = lambda e=e: (lambda g: (g.total_s - g.ttft_s) / (steps - 1))(
            e.generate(req, "full", params=many))
    times = interleaved(fns, rounds)
    med = medians(times)
    print(f"\nprompt: {len(req)} tokens; torch threads {torch.get_num_threads()}; {rounds} rounds (medians)\n")
    print("| precision | full prefill (s) | question on a cached prefix (s) | decode (ms/token) | prefill / fp32 | "
          "decode / fp32 |")
    print("|---|---|---|---|---|---|")
    for p in engines:
        rel = ("-", "-") if "fp32" not in engines else (
            f"{median_ratio(times[f'{p} prefill'], times['fp32 prefill']):.2f}",
            f"{median_ratio(times[f'{p} decode step'], times['fp32 decode step']):.2f}")
        print(f"| {p} | {med[f'{p} prefill']:.3f} | {med[f'{p} cached prefix']:.3f} | "
              f"{1000 * med[f'{p} decode step']:.1f} | {rel[0]} | {rel[1]} |")


def fidelity(engines, tok, cases: int, steps: int) -> None:  # type: ignore[no-untyped-def]
    from kvfuse.engine.sampling import SamplingParams
    from kvfuse.eval.metrics import fidelity as compare

    ref_engine = engines["fp32"]
    params, one = SamplingParams(max_tokens=steps), SamplingParams(max_tokens=1)
    rows: dict[str, list[tuple[float, float, float]]] = {p: [] for p in engines if p != "fp32"}
    for case in musique_cases()[:cases]:
        req = musique_prompt(case, 6).request(tok)
        ref = ref_engine.generate(req, "full", params=params, record_logits=True)
        assert ref.step_logits is not None
        answer = [int(t) for t in ref.step_logits.argmax(-1)]
        for p in rows:
            g = engines[p].generate(req, "full", params=one, score=answer)
            assert g.scored_logits is not None
            f = compare(ref.step_logits, g.scored_logits, answer)
            rows[p].append((f.first_token_agreement, f.token_agreement, f.kl))
    print(f"\nfidelity against fp32: {cases} MuSiQue dev cases, 6 passages, fp32's greedy answer of up to "
          f"{steps} tokens\n")
    print("| precision | first-token agreement | token agreement | KL(fp32 ‖ precision) |")
    print("|---|---|---|---|")
    for p, vals in rows.items():
        print(f"| {p} | {statistics.mean(v[0] for v in vals):.3f} | {statistics.mean(v[1] for v in vals):.3f} | "
              f"{statistics.mean(v[2] for v in vals):.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--precisions", default="fp32,bf16,int8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--cases", type=int, default=50)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-fidelity", action="store_true")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--rss", default=None, help=argparse.SUPPRESS)  # the child process of the memory column
    args = ap.parse_args()
    if args.rss:
        return rss(args.model, args.rss, args.steps)
    precisions = args.precisions.split(",")
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, torch {torch.__version__}")
    peak = {}
    for p in [] if args.skip_rss else precisions:  # one fresh process each, before this one loads anything
        cmd = [sys.executable, __file__, "--rss", p, "--steps", str(args.steps)] + (
            ["--model", args.model] if args.model else [])
        peak[p] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    print("\n| precision | peak RSS (MiB) | / fp32 |\n|---|---|---|")
    for p in peak:
        base = peak.get("fp32", peak[p])["peak_rss_mib"]
        print(f"| {p} | {peak[p]['peak_rss_mib']:.0f} | {peak[p]['peak_rss_mib'] / base:.2f} |")
    engines, tok = _engines(args.model, precisions)
    if not args.skip_speed:
        speed(engines, tok, args.rounds, args.steps)
    if not args.skip_fidelity and "fp32" in engines:
        fidelity(engines, tok, args.cases, args.steps)


if __name__ == "__main__":
    main()
