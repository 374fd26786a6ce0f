"""Low-bit products for the rows of a decoding step, side by side (issue R, point 2).

    .venv/bin/python benchmarks/lowbit_kernels.py [--rounds 7] [--rows 1,2,4,8,16]

An 8192 x 2048 weight (a 1B model's gate or up projection), each candidate in its own format, times
`rows` float32 input rows, 2 threads; medians of interleaved rounds (each round runs every candidate
once at every row count, 20 products each). Candidates:
- `lowbit4`, `lowbit8`: kvfuse's kernel (`kernels/lowbit.c`) on 4-bit groups of 32 with a float32
  scale and offset (Q4_K's form) and on 8-bit groups of 32 (Q8_0's);
- `int4pack`: torch's `_weight_int4pack_mm_for_cpu`, groups of 32, bfloat16 input and scales (what
  torchao 0.18's CPU int4 layout calls; its PyPI wheel carries no CPU kernels of its own);
- `int8pack`: torch's `_weight_int8pack_mm` (one scale per row, bfloat16 input);
- `fbgemm-w8a8`: FBGEMM's int8 x int8 (`w8a8.py`, one scale per row: not faithful on Gemma 3);
- `fbgemm-fp16`: FBGEMM's float16-weight product (bf16's decoding steps);
- `fp32`: oneDNN's packed float32 product (fp32's).
GB/s is the weight's bytes in its format over the median time: the weight fits in this CPU's L3
cache between products, so it is the kernel's rate, not the memory's (a model's steps read DRAM).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name  # noqa: E402

N, K = 8192, 2048


def candidates() -> dict[str, tuple[Callable[[torch.Tensor], object], int]]:
    from kvfuse import lowbit, packed, w8a8

    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(0)
    out: dict[str, tuple[Callable[[torch.Tensor], object], int]] = {}
    q4 = lowbit.pack(torch.randint(0, 16, (N, K), generator=g, dtype=torch.int8), torch.rand(N, K // 32) * 0.01,
                     torch.rand(N, K // 32) * 0.01, 32, 4)
    out["lowbit4"] = (lambda x: lowbit.matmul(x, q4), q4.nbytes)
    q8 = lowbit.pack(torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8), torch.rand(N, K // 32) * 0.01,
                     None, 32, 8)
    out["lowbit8"] = (lambda x: lowbit.matmul(x, q8), q8.nbytes)
    ints = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    packed4 = torch._convert_weight_to_int4pack_for_cpu(ints, 1)
    sz = torch.rand(K // 32, N, 2, generator=g).bfloat16()
    out["int4pack"] = (lambda x: torch._weight_int4pack_mm_for_cpu(x.bfloat16(), packed4, 32, sz),
                       N * K // 2 + sz.numel() * 2)
    i8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    s8 = torch.rand(N, generator=g).bfloat16()
    out["int8pack"] = (lambda x: torch._weight_int8pack_mm(x.bfloat16(), i8, s8), N * K + N * 2)
    if w8a8.available():
        pw = w8a8.pack(i8, torch.rand(N, generator=g))
        out["fbgemm-w8a8"] = (lambda x: w8a8.matmul(x, pw, N), N * K)
    w = torch.randn(N, K, generator=g) * 0.02
    if packed.fp16_steps_available():
        p16 = torch.ops.quantized.linear_prepack_fp16(w, None)
        out["fbgemm-fp16"] = (lambda x: torch.ops.quantized.linear_dynamic_fp16(x, p16), N * K * 2)
    if packed.available():
        lin = packed.PackedLinear(torch.nn.Linear(K, N, bias=False))
        out["fp32"] = (lambda x: lin(x), N * K * 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", default="1,2,4,8,16")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = [int(r) for r in args.rows.split(",")]
    cands = candidates()
    xs = {r: torch.randn(r, K, generator=torch.Generator().manual_seed(r)) for r in rows}
    times: dict[tuple[str, int], list[float]] = {}
    for rnd in range(args.rounds + 1):
        for name, (fn, _) in cands.items():
            for r in rows:
                t = time.perf_counter()
                for _ in range(20):
                    fn(xs[r])
                if rnd:
                    times.setdefault((name, r), []).append((time.perf_counter() - t) / 20)
    print(f"{cpu_name()}, torch {torch.__version__}, 2 threads, {N} x {K}, {args.rounds} interleaved rounds\n")
    print("| kernel | " + " | ".join(f"{r} row{'s' if r > 1 else ''} (ms)" for r in rows) + " | GB/s at 1 row |")
    print("|---|" + "---|" * (len(rows) + 1))
    for name, (_, nbytes) in cands.items():
        med = [statistics.median(times[(name, r)]) for r in rows]
        print(f"| {name} | " + " | ".join(f"{1000 * m:.3f}" for m in med) + f" | {nbytes / med[0] / 1e9:.1f} |")


if __name__ == "__main__":
    main()
