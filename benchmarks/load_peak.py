"""The peak memory of loading a GGUF at precision lowbit, first (packing its blocks) and second (mapping
the kept conversion), and the 8B arithmetic from it (issue R).

    .venv/bin/python benchmarks/scale.py --write 1b,3b        # the GGUFs, once
    .venv/bin/python benchmarks/load_peak.py --sizes 1b,3b [--out F.json]

Each load runs in a fresh process with a fresh cache dir (first) and then again (second); the peak is
the process's VmHWM after `weights.load_model`, less what it held before the load (Python, torch). The
model's own bytes are the packed weights and the float tensors it keeps. The 8B line scales each
size's bytes per weight and its packing overhead (peak growth less the model: one part's temporaries)
to Llama 3 8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14,336, vocabulary 128,256,
untied head).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name  # noqa: E402
from scale import SHAPES, gguf_path  # noqa: E402

PROBE = r'''
import json, sys
from pathlib import Path
def rss(field):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024
import torch
from kvfuse.weights import load_model
from kvfuse import lowbit
before = rss("VmRSS")
m = load_model(sys.argv[1], "lowbit").model
packed = sum(x.nbytes for x in m.modules() if isinstance(x, lowbit.LowBitRows))
other = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "part" not in n)
print(json.dumps({"growth": rss("VmHWM") - before, "held": rss("VmRSS") - before, "packed": packed,
                  "other": other, "weights": sum(p.shape[0] * p.cols for x in m.modules()
                                                 if isinstance(x, lowbit.LowBitRows) for p in x.parts)}))
'''

LLAMA3_8B = (4096, 32, 32, 8, 14336, 128256)


def params(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, tied: bool) -> int:
    head_dim = hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * ffn
    return layers * per_layer + vocab * hidden * (1 if tied else 2)


def probe(gguf: Path, cache: Path) -> dict:  # type: ignore[type-arg]
    env = dict(os.environ, KVFUSE_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-c", PROBE, str(gguf)], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1b,3b")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for size in args.sizes.split(","):
        cache = Path(tempfile.mkdtemp(prefix="kvfuse-peak-"))
        first, second = probe(gguf_path(size), cache), probe(gguf_path(size), cache)
        n = params(*SHAPES[size], 49152, True)
        row = {"size": size, "params": n, "first": first, "second": second,
               "bytes_per_weight": first["packed"] / first["weights"],
               "overhead": first["growth"] - first["packed"] - first["other"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    n8 = params(*LLAMA3_8B, tied=False)
    bpw = max(r["bytes_per_weight"] for r in rows)
    ffn_ratio = LLAMA3_8B[4] * LLAMA3_8B[0] / max(SHAPES[r["size"]][4] * SHAPES[r["size"]][0] for r in rows)
    overhead = max(r["overhead"] for r in rows) * max(1.0, ffn_ratio)  # one part's temporaries, scaled to 8B's
    estimate = n8 * bpw + overhead
    print(f"8B (Llama 3 shape, {n8 / 1e9:.2f} B weights): {n8 / 1e9:.2f} B x {bpw:.3f} bytes a weight "
          f"+ {overhead / 1e9:.2f} GB of one part's temporaries = {estimate / 1e9:.2f} GB at a first load's peak")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_name(), "rows": rows, "8b_estimate_bytes": estimate,
                                        "8b_params": n8, "bytes_per_weight": bpw, "overhead": overhead}, indent=1))


if __name__ == "__main__":
    main()
