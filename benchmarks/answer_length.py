"""How long the bundled Albarán questions' answers are, to size the default answer length (issue L).

    .venv/bin/python benchmarks/answer_length.py [--limit 128] [--store DIR]

Every bundled question is answered by CAG (which equals full prefill, token for token:
tests/test_kb.py and benchmarks/kb_cag.py) with a generous token limit. It prints the answer length in
tokens, counted up to the first newline after the answer starts, as percentiles, with how many answers
still reached the limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
from importlib import resources

from kvfuse.engine.sampling import SamplingParams
from kvfuse.kb import answer
from kvfuse.runtime import open_engine, open_kb, store_dir
from kvfuse.text.deltas import TextDeltas


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=128)
    ap.add_argument("--store", default=None)
    args = ap.parse_args()
    where = store_dir(args.store)
    rt = open_engine(None, where)
    kb = open_kb("albaran", rt, where)
    questions = json.loads(resources.files("kvfuse").joinpath("data/albaran/questions.json").read_text())
    lengths, at_limit, empty = [], 0, 0
    for q in questions:
        group = q.get("group") or "support"
        prep = answer.prepare(kb, q["question"], group)
        answer.warm(kb, prep)
        stream = rt.engine.stream(prep.request, prep.mode, None, SamplingParams(max_tokens=args.limit))
        deltas = TextDeltas(rt.tok, lead_in=True)
        n = 0
        for t in stream:
            deltas.push(t)
            if deltas.stopped:
                break
            n += 1
        stream.close()
        text = rt.tok.decode(deltas.ids).strip()
        lengths.append(n)
        at_limit += int(n >= args.limit)
        empty += int(not text.split("\n")[0].strip())
    qs = statistics.quantiles(lengths, n=20)
    out = {"questions": len(lengths), "limit": args.limit, "reached_limit": at_limit, "empty": empty,
           "median": statistics.median(lengths), "p75": qs[14], "p90": qs[17], "p95": qs[18], "max": max(lengths)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
