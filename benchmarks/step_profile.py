"""Where a decoding step spends its time (issue H, item 2), per precision, on one machine, in one run.

    .venv/bin/python benchmarks/step_profile.py [--steps 16] [--passages 6] [--precisions fp32,int8]

MuSiQue dev case 0 (6 passages) is prefilled, then `--steps` greedy steps run under torch.profiler
(`Engine.advance` on a batch of one, EOS ignored), after `--steps`/2 unprofiled ones that give the
step's wall time. That time is split by the profiled operators' own (self) CPU time into: weight
matmuls (linear layers, and the LM head or its int8 screen), attention (SDPA), copies and KV writes,
views, and every other operator (norms, RoPE, activations); what no operator accounts for is Python
and dispatch overhead (slightly underestimated: the profiler's cost lands in the operators' times).
Against it: the time to read the step's weights once at this machine's measured memory bandwidth (a
large tensor summed), the floor a memory-bound step cannot beat.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import musique_cases, musique_prompt  # noqa: E402

from kvfuse.checkpoints import resolve_model_path  # noqa: E402
from kvfuse.engine import Engine  # noqa: E402
from kvfuse.engine.sampling import SamplingParams  # noqa: E402
from kvfuse.text import Tokenizer  # noqa: E402

GROUPS = {  # operator name fragment -> group (first match wins)
    "_weight_int8pack_mm": "weight matmuls", "mkldnn::_linear_pointwise": "weight matmuls",
    "aten::mm": "weight matmuls", "aten::addmm": "weight matmuls",
    "quantized::linear": "weight matmuls",  # FBGEMM: the greedy head's int8 screen (and w8a8's linears)
    "aten::bmm": "attention",  # a decoding row's attention: keys times queries, then the weighted values
    "aten::linear": None, "aten::matmul": None,  # wrappers: their time is in their children
    "scaled_dot_product": "attention", "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::copy_": "copies and KV writes", "aten::index_put": "copies and KV writes",
    "aten::slice": "views", "aten::select": "views", "aten::view": "views", "aten::transpose": "views",
    "aten::as_strided": "views", "aten::reshape": "views", "aten::unsqueeze": "views", "aten::expand": "views",
}


def bandwidth() -> float:
    """Bytes per second of summing a 1 GiB float32 tensor (median of 5)."""
    x = torch.ones(1 << 28)
    x.sum()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t)
    return x.numel() * 4 / sorted(ts)[2]


def weight_bytes(engine: Engine) -> int:
    """What one greedy step reads: every parameter and buffer, and the weights prepacked for oneDNN (the
    int8 screen instead of a float32 head)."""
    from kvfuse.packed import PackedLinear

    m = engine.model
    head = engine.greedy_head()
    tables = {m.embed_tokens, getattr(m, "lm_head", None)} if head is not None else set()
    # the screen reads its int8 table and row bounds, not the head itself (nor a tied table's lookups' rows)
    mods = [mod for name, mod in m.named_children() if mod not in tables]
    total = sum(t.numel() * t.element_size() for mod in mods for t in [*mod.parameters(), *mod.buffers()])
    total += sum(p.dtype.itemsize * p.in_features * p.out_features for p in m.modules() if isinstance(p, PackedLinear))
    if head is not None:
        total += sum(t.numel() * t.element_size() for k, t in vars(head).items()
                     if isinstance(t, torch.Tensor) and k != "weight")
        if head.kernel == "w8a8":  # FBGEMM's packed int8 rows, not a tensor (its `q` is emptied)
            total += head.weight.shape[0] * head.weight.shape[1]
    return total


def group_of(name: str) -> str | None:
    for frag, g in GROUPS.items():
        if frag in name:
            return g
    return "other operators"


def profile(engine: Engine, req, steps: int) -> tuple[float, dict[str, float]]:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=2 * steps + 2, ignore_eos=True)
    engine.draft_tokens = 0  # one token a step: drafts would finish the request early (MuSiQue copies)
    d = engine.begin(req, "full", params=params)
    engine.advance([d])  # warm: the slot is made here
    t0 = time.perf_counter()
    for _ in range(steps // 2):  # the step's time without the profiler's own cost
        engine.advance([d])
    wall = (time.perf_counter() - t0) / (steps // 2)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            engine.advance([d])
    d.close()
    by: dict[str, float] = defaultdict(float)
    for ev in p.key_averages():
        g = group_of(ev.key)
        if g is not None and g != "views":
            by[g] += ev.self_cpu_time_total / 1e6 / steps
    by["views"] = sum(ev.self_cpu_time_total for ev in p.key_averages() if group_of(ev.key) == "views") / 1e6 / steps
    return wall, dict(by)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--precisions", default="fp32,int8")
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = resolve_model_path(None)
    req = musique_prompt(musique_cases()[0], args.passages).request(Tokenizer(path))
    bw = bandwidth()
    print(f"machine: {platform.machine()} {platform.processor()}, torch {torch.__version__}, 2 threads; prompt "
          f"{len(req)} tokens; {args.steps} profiled steps; memory bandwidth (sum of 1 GiB) {bw / 1e9:.1f} GB/s\n")
    print("| precision | step (ms) | weight matmuls | attention | copies and KV writes | other operators "
          "| views | Python and dispatch (rest) | weights read (MB) | bandwidth floor (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in args.precisions.split(","):
        engine = Engine.load(path, precision=p)
        wall, by = profile(engine, req, args.steps)
        rest = wall - sum(by.values())
        wb = weight_bytes(engine)
        cells = [by.get(g, 0.0) for g in ("weight matmuls", "attention", "copies and KV writes", "other operators",
                                           "views")]
        print(f"| {p} | {1000 * wall:.1f} | " + " | ".join(f"{1000 * c:.1f}" for c in cells)
              + f" | {1000 * rest:.1f} | {wb / 1e6:.0f} | {1000 * wb / bw:.1f} |", flush=True)
        del engine


if __name__ == "__main__":
    main()
