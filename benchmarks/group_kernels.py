"""Kernels for weights in groups at a decoding step's 1 to 8 rows (issue M, point 3), side by side.

    .venv/bin/python benchmarks/group_kernels.py [--rounds 5]

One Gemma 3 270M gate/up projection (4096 x 640), float32 input rows, 2 threads:
- `fp32 packed`: fp32's oneDNN-prepacked float32 weight (`packed.PackedLinear`), the baseline;
- `groups`: precision groups' product (`groups.group_matmul`): int8 values and a float32 scale per 32
  dequantised into a reused buffer, then the float32 kernel (exact);
- `int8 rows`: `torch._weight_int8pack_mm`, one bfloat16 scale per output row (precision int8: not the
  checkpoint's groups; input rounded to bfloat16);
- `int4 groups`: torch's `_weight_int4pack_mm_for_cpu`, 4-bit values with a bfloat16 scale and zero
  per group of 32: the only kernel torch ships that reads groups, but only 4-bit ones (Q4_K, Q4_0,
  Q4_1: not Q5_0, Q6_K or Q8_0, most of Gemma's GGUF) and with bfloat16 scales (not exact), with
  bfloat16 input rows; with float32 rows it is far slower.
Each round runs every kernel once (50 calls each); medians of the rounds, and the weight bytes each
reads per call over its time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name  # noqa: E402

N, K, CALLS = 4096, 640, 50


def timed(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    for _ in range(CALLS):
        f()
    return (time.perf_counter() - t) / CALLS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from kvfuse import groups, packed

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=gen) * 0.05
    lin = torch.nn.Linear(K, N, bias=False)
    lin.weight.data = w.clone()
    fp32 = packed.PackedLinear(lin, (), torch.float32) if packed.available() else lin
    g = groups.quantize(w)
    q8 = g.values
    row_scale = (w.abs().amax(1) / 127).to(torch.bfloat16)
    q4 = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=gen)
    q4_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
    scales_zeros = (torch.rand(K // 32, N, 2, generator=gen) * 0.01).to(torch.bfloat16)
    kernels: dict[str, tuple[int, Callable[[torch.Tensor], object]]] = {
        "fp32 packed": (4 * N * K, lambda x: fp32(x)),
        "groups (exact)": (g.nbytes, lambda x: groups.group_matmul(x, g)),
        "int8 rows": (N * K + 2 * N, lambda x: torch._weight_int8pack_mm(x.to(torch.bfloat16), q8, row_scale)),
        "int4 groups, bf16 rows": (N * K // 2 + 4 * N * K // 32, lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), q4_packed, 32, scales_zeros)),
    }
    rows = (1, 2, 8)
    times: dict[tuple[str, int], list[float]] = {(k, r): [] for k in kernels for r in rows}
    xs = {r: torch.randn(r, K, generator=gen) for r in rows}
    with torch.inference_mode():
        for _, f in kernels.values():
            for r in rows:
                f(xs[r])  # warm-up
        for _ in range(args.rounds):
            for r in rows:
                for name, (_, f) in kernels.items():
                    times[(name, r)].append(timed(lambda f=f, r=r: f(xs[r])))
    print(f"\n{cpu_name()}; torch {torch.__version__}, 2 threads; a {N} x {K} weight; {args.rounds} interleaved rounds "
          f"of {CALLS} calls; median ms per call (GB/s of weight bytes read)\n")
    print("| kernel | weight bytes | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for name, (nbytes, _) in kernels.items():
        cells = []
        for r in rows:
            s = statistics.median(times[(name, r)])
            cells.append(f"{s * 1e3:.3f} ({nbytes / s / 1e9:.0f})")
        print(f"| {name} | {nbytes / 1e6:.1f} MB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
