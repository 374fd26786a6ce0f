"""The bundled Albarán questions answered in each precision, against fp32's answers (issue H, part 1).

    .venv/bin/python benchmarks/compare_precisions.py [--precisions fp32,bf16,int8] [--methods cag]
        [--cases 62] [--max-tokens 48] [--out DIR]

Runs `kvfuse compare --kb albaran` once per precision (a fresh process each, one shared store under
`--out`, quote requests off: they are a second generation per question), then prints, per precision
and method: contains-gold accuracy, answer F1 against the gold answers, how many answers are the same
text as fp32's, and how many begin with the same first word (what a reader sees first). Each run's
`compare.json` stays under `--out/<precision>`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "kvfuse" / "data" / "albaran" / "questions.json"


def run(precision: str, methods: str, cases: int, max_tokens: int, out: Path) -> dict:  # type: ignore[type-arg]
    dest = out / precision
    cmd = [sys.executable, "-m", "kvfuse", "compare", "--kb", "albaran", "--questions", str(QUESTIONS),
           "--methods", methods, "--cases", str(cases), "--max-tokens", str(max_tokens), "--no-quote",
           "--precision", precision, "--store", str(out / "store"), "--out", str(dest), "--quiet", "--json"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((dest / "compare.json").read_text())  # type: ignore[no-any-return]


def first_word(text: str) -> str:
    words = text.strip().split()
    return words[0].strip(".,;:").lower() if words else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="fp32,bf16,int8")
    ap.add_argument("--methods", default="cag")
    ap.add_argument("--cases", type=int, default=62)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    precisions = args.precisions.split(",")
    if precisions[0] != "fp32":
        ap.error("the first precision must be fp32: the others are compared with its answers")
    out = args.out or Path(tempfile.mkdtemp(prefix="kvfuse-compare-precisions-"))
    runs = {p: run(p, args.methods, args.cases, args.max_tokens, out) for p in precisions}
    print(f"outputs: {out}\n")
    print("| precision | method | contains gold | F1 | same answer as fp32 | same first word as fp32 "
          "| TTFT median (s) |")
    print("|---|---|---|---|---|---|---|")
    ref = runs["fp32"]["per_question"]
    for p, res in runs.items():
        for m, summary in res["methods"].items():
            pairs = [(a["methods"][m]["answer"], b["methods"][m]["answer"])
                     for a, b in zip(ref, res["per_question"], strict=True)]
            same = sum(x.strip() == y.strip() for x, y in pairs)
            word = sum(first_word(x) == first_word(y) for x, y in pairs)
            print(f"| {p} | {m} | {summary['accuracy']:.3f} | {summary['f1']:.3f} | {same} / {len(pairs)} | "
                  f"{word} / {len(pairs)} | {summary['ttft_s_median']:.3f} |")


if __name__ == "__main__":
    main()
