"""bf16's decoding steps on FBGEMM's float16 copy of the weights against oneDNN's bfloat16 pack (stop 51).

    .venv/bin/python benchmarks/step_kernels.py [--rounds 5] [--context 10000]

1. **The layers' products alone**: every linear of the 18 layers of Gemma 3 270M (200 MB of 2-byte
   weights) on 1 to 32 rows, `PackedLinear.forward` (oneDNN, bfloat16 rows) against `PackedLinear.step`
   (FBGEMM, float32 rows), and the bytes a step reads over its time.
2. **Whole decoding steps** (`decode.step_rows`, head aside) of 1, 2, 4 and 7 rows (a draft of 6) on the
   real bf16 model with a random cache of `--context` tokens, with the float16 copy and without it (the
   layers' `step_parts` emptied for those runs: a step then runs the prefill's kernel, as before), and
   with the copy but each row's attention its own calls (`model.shares_values` and `batches_windows`
   refused: as before `Decoder.attend_rows` and `attend_windows`).
3. **Fidelity of the steps**: on MuSiQue dev cases' prompts, teacher-forced steps of the fp32 model's
   own greedy answer, the bf16 steps' logits against fp32's (KL and top-1 agreement), with and without
   the copy.
Interleaved, medians of `--rounds` rounds, ratios per round; the CPU is printed with them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, median_ratio, musique_cases, musique_prompt, timed  # noqa: E402

from kvfuse import model as model_mod  # noqa: E402
from kvfuse.checkpoints import resolve_model_path  # noqa: E402
from kvfuse.engine import Engine  # noqa: E402
from kvfuse.engine.decode import Slot, step_hidden, step_rows  # noqa: E402
from kvfuse.kv import KVCache  # noqa: E402
from kvfuse.metrics import kl_divergence  # noqa: E402
from kvfuse.packed import PackedLinear  # noqa: E402
from kvfuse.text import Tokenizer  # noqa: E402


@contextmanager
def unshared() -> Iterator[None]:
    """Every row's attention calls its own: `Decoder.attend_rows` without shared values, `attend_windows`
    without batched windows."""
    shares, batches = model_mod.shares_values, model_mod.batches_windows
    model_mod.shares_values = lambda *a: False  # type: ignore[assignment]
    model_mod.batches_windows = lambda *a: False  # type: ignore[assignment]
    try:
        yield
    finally:
        model_mod.shares_values, model_mod.batches_windows = shares, batches


@contextmanager
def without_copy(linears: list[PackedLinear]) -> Iterator[None]:
    """Steps on the prefill's kernel: the float16 copies set aside for the block."""
    copies = [m.step_parts for m in linears]
    for m in linears:
        m.step_parts = []
    try:
        yield
    finally:
        for m, c in zip(linears, copies, strict=True):
            m.step_parts = c


def products(linears: list[PackedLinear], rounds: int) -> None:
    nbytes = sum(m.in_features * m.out_features * 2 for m in linears)
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {}
    counts = (1, 2, 4, 8, 16, 32)
    xs = {(r, m.in_features): torch.randn(r, m.in_features, generator=g) for r in counts for m in linears}
    with torch.inference_mode():
        for _ in range(rounds):
            for r in counts:
                for name, call in (("onednn", lambda m, x: m(x)), ("fbgemm", lambda m, x: m.step(x))):
                    run = lambda: [call(m, xs[r, m.in_features]) for m in linears]  # noqa: B023, E731
                    run()
                    times.setdefault(f"{r} {name}", []).append(timed(run, 5))
    print(f"\n1. Every layer's products ({nbytes / 1e6:.0f} MB of weights), median of {rounds} rounds\n")
    print("| rows | oneDNN bfloat16 (ms, GB/s) | FBGEMM float16 (ms, GB/s) | FBGEMM / oneDNN |")
    print("|---|---|---|---|")
    for r in counts:
        a, b = times[f"{r} onednn"], times[f"{r} fbgemm"]
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {r} | {1000 * ma:.2f} ({nbytes / ma / 1e9:.1f}) | {1000 * mb:.2f} ({nbytes / mb / 1e9:.1f}) | "
              f"**{median_ratio(b, a):.2f}** |")


def steps(engine: Engine, linears: list[PackedLinear], rounds: int, context: int) -> None:
    m, cfg = engine.model, engine.model.cfg
    shape = (cfg.num_layers, cfg.num_kv_heads, context, cfg.head_dim)
    g = torch.Generator().manual_seed(0)
    slot = Slot(m, KVCache(torch.randn(shape, generator=g), torch.randn(shape, generator=g),
                           torch.arange(context)), 64)

    def step(rows: int) -> Callable[[], None]:
        def run() -> None:
            step_rows(m, [slot], [list(range(5, 5 + rows))])
            slot.rewind(rows)
        return run

    counts = (1, 2, 4, 7)
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for rows in counts:
                times.setdefault(f"{rows} copy", []).append(timed(step(rows), 5))
                with unshared():
                    times.setdefault(f"{rows} unshared", []).append(timed(step(rows), 5))
                    with without_copy(linears):
                        times.setdefault(f"{rows} before", []).append(timed(step(rows), 5))
    print(f"\n2. Decoding steps over {context} keys (bf16, the head aside), median of {rounds} rounds\n")
    print("| rows | prefill's kernel, own values (ms) | float16 copy, own values (ms) | float16 copy, shared values "
          "(ms) | copy / before | copy and shared / before |")
    print("|---|---|---|---|---|---|")
    for rows in counts:
        a, b, c = times[f"{rows} before"], times[f"{rows} unshared"], times[f"{rows} copy"]
        print(f"| {rows} | {1000 * statistics.median(a):.2f} | {1000 * statistics.median(b):.2f} | "
              f"{1000 * statistics.median(c):.2f} | **{median_ratio(b, a):.2f}** | **{median_ratio(c, a):.2f}** |")


def fidelity(engine: Engine, oracle: Engine, linears: list[PackedLinear], cases: int, tokens: int) -> None:
    """Teacher-forced steps over the fp32 model's greedy answer: bf16's step logits against fp32's."""
    tok = Tokenizer(resolve_model_path(None))
    from kvfuse.engine.sampling import SamplingParams

    def step_logits(e: Engine, prompt: object, answer: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            fused = e.prefill(prompt, room=len(answer) + 1).fused  # type: ignore[arg-type]
            slot = Slot(e.model, fused.cache, len(answer) + 1)
            return torch.cat([e.model.logits(step_hidden(e.model, [slot], [t])) for t in answer]).float()

    sums: dict[str, list[float]] = {"copy": [0.0, 0.0], "before": [0.0, 0.0]}
    n = 0
    for case in musique_cases()[:cases]:
        req = musique_prompt(case, 6).request(tok)
        answer = list(oracle.generate(req, "full", params=SamplingParams(max_tokens=tokens, ignore_eos=True)).tokens)
        want = step_logits(oracle, req, answer)
        for name in ("copy", "before"):
            if name == "before":
                with without_copy(linears):
                    got = step_logits(engine, req, answer)
            else:
                got = step_logits(engine, req, answer)
            sums[name][0] += sum(kl_divergence(w, g) for w, g in zip(want, got, strict=True))
            sums[name][1] += int((got.argmax(-1) == want.argmax(-1)).sum())
        n += len(answer)
    print(f"\n3. Teacher-forced steps, {cases} MuSiQue dev cases (6 passages), {tokens} tokens of fp32's "
          "greedy answer\n")
    print("| bf16 steps | mean KL to fp32 | top-1 agreement |")
    print("|---|---|---|")
    for name, label in (("before", "prefill's kernel (bfloat16 rows)"), ("copy", "float16 copy (float32 rows)")):
        kl, agree = sums[name]
        print(f"| {label} | {kl / n:.6f} | {agree:.0f}/{n} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=10_000)
    ap.add_argument("--cases", type=int, default=10, help="MuSiQue dev cases for the fidelity part (0: skip it)")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(2)
    engine = Engine.load(resolve_model_path(None), precision="bf16")
    linears = [m for m in engine.model.modules() if isinstance(m, PackedLinear) and m.step_parts]
    if not linears:
        raise SystemExit("this PyTorch keeps no float16 copy for steps (no FBGEMM, or no oneDNN)")
    print(f"{cpu_name()}; torch {torch.__version__}, 2 threads; {time.strftime('%Y-%m-%d %H:%M')}")
    products(linears, args.rounds)
    steps(engine, linears, args.rounds, args.context)
    if args.cases:
        fidelity(engine, Engine.load(resolve_model_path(None), precision="fp32"), linears, args.cases, args.tokens)


if __name__ == "__main__":
    main()
