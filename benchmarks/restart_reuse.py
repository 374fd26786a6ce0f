"""Issue B: a second process answers from the chunk caches a first process wrote to disk.

    .venv/bin/python benchmarks/restart_reuse.py [--pairs 5] [--passages 6]

Each pair runs `kvfuse generate --mode blend --json` twice as separate processes on a fresh store dir:
the first prepares the chunk caches (precompute_s) and answers from memory; the second finds them on
disk, and its ttft_s includes loading them layer by layer. Reports medians over the pairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import musique_cases  # noqa: E402


def run(argv: list[str]) -> dict:  # type: ignore[type-arg]
    out = subprocess.run([sys.executable, "-m", "kvfuse", *argv], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--passages", type=int, default=6)
    args = ap.parse_args()
    case = musique_cases()[0]
    tmp = Path(tempfile.mkdtemp(prefix="kvfuse-restart-"))
    files = []
    for i, c in enumerate(case["ctxs"][: args.passages]):
        (tmp / f"c{i}.txt").write_text(c["text"])
        files += ["--chunk-file", str(tmp / f"c{i}.txt")]
    rows = []
    for p in range(args.pairs):
        argv = ["generate", *files, "--question", case["question"], "--mode", "blend", "--max-tokens", "8", "--json",
                "--store", str(tmp / f"store{p}")]
        first, second = run(argv), run(argv)
        assert second["answer"] == first["answer"], (first["answer"], second["answer"])
        rows.append((first, second))
        print(f"pair {p + 1}: first ttft {first['ttft_s']:.3f}s precompute {first['precompute_s']:.3f}s | second "
              f"ttft {second['ttft_s']:.3f}s precompute {second['precompute_s']:.3f}s store {second['store']}",
              flush=True)

    def med(i: int, field: str) -> float:
        return statistics.median(r[i][field] for r in rows)

    print("\n| run | ttft_s median | precompute_s median | chunks from |")
    print("|---|---|---|---|")
    print(f"| first process | {med(0, 'ttft_s'):.3f} | {med(0, 'precompute_s'):.3f} | memory (just computed) |")
    print(f"| second process | {med(1, 'ttft_s'):.3f} | {med(1, 'precompute_s'):.3f} | disk (pipelined load) |")
    print(f"\nsecond / first ttft: {med(1, 'ttft_s') / med(0, 'ttft_s'):.2f}x; same answer in every pair")


if __name__ == "__main__":
    main()
