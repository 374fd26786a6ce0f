"""The per-token cost of a grammar (issue N.3): `response_format` / `ask --json-schema` on the default
model, the cached Albarán prefix, greedy.

    .venv/bin/python benchmarks/grammar_mask.py [--precision P] [--rounds 5] [--tokens 24]

Reports, interleaved, medians of 5 rounds:
- the mask alone per token: llguidance's bitmask for the grammar's state (`Grammar.allowed`: the fill
  and its unpacking to one bool per token of the 262k vocabulary) and applying it to the logits;
- whole answers per token: a JSON-schema answer (the whole float head, masked, no drafts) against the
  plain answer to the same question (the int8 screen, drafts), each 24 tokens (EOS ignored; the JSON
  answer ends when its grammar is complete).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"days": {"type": "integer"}, "annual": {"type": "boolean"},
                                           "plan": {"type": "string", "maxLength": 40}},
          "required": ["days", "annual", "plan"], "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()

    import torch

    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.engine import Engine
    from kvfuse.engine.sampling import SamplingParams, masked
    from kvfuse.kb import answer
    from kvfuse.kb.base import KnowledgeBase
    from kvfuse.kb.manifest import resolve_kb_dir
    from kvfuse.precision import default_precision
    from kvfuse.server.grammar import Grammar, grammar_for
    from kvfuse.text import Tokenizer

    torch.set_num_threads(2)
    precision = args.precision or default_precision()
    tmp = Path(tempfile.mkdtemp(prefix="kvfuse-grammar-"))
    shutil.copytree(resolve_kb_dir("albaran"), tmp / "albaran")
    path = resolve_model_path(None)
    tok = Tokenizer(path)
    engine = Engine.load(path, store_dir=tmp / "store", precision=precision)
    kb = KnowledgeBase.open(tmp / "albaran", engine, tok, state_dir=tmp / "store")
    kb.build("support")
    question = "How many days does a Team plan customer have to ask for a refund on an annual renewal?"
    req = answer.prepare(kb, question, "support").request
    grammar = grammar_for({"type": "json_schema", "json_schema": {"name": "refund", "schema": SCHEMA}})
    assert grammar is not None
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    Grammar(tok.hf, grammar)  # compile the tokenizer once, before timing

    times: dict[str, list[float]] = {}

    def per_token(name: str, g: object) -> None:
        times.setdefault(name, []).append((g.total_s - g.ttft_s) / max(1, len(g.tokens) - 1))  # type: ignore[attr-defined]

    json_tokens: list[int] = []
    for r in range(args.rounds + 1):
        g = engine.generate(req, "prefix", params=params, constraint=Grammar(tok.hf, grammar))
        json_tokens = g.tokens
        plain = engine.generate(req, "prefix", params=params)
        if r:  # the first round warms up
            per_token("json answer (grammar)", g)
            per_token("plain answer", plain)
        # the mask alone, replayed over the JSON answer's tokens
        gr, logits = Grammar(tok.hf, grammar), torch.zeros(engine.cfg.vocab_size)
        t0 = time.perf_counter()
        for t in g.tokens:
            masked(logits, gr)
            gr.advance(t)
            if gr.finished():
                break
        if r:
            times.setdefault("mask per token", []).append((time.perf_counter() - t0) / max(1, len(g.tokens)))
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu = cpu_name()
    print(f"{cpu}; torch {torch.__version__}; precision {precision}; 2 threads; {args.rounds} rounds; "
          f"JSON answer {tok.decode(json_tokens)!r}")
    print("\n| | ms per token |\n|---|---|")
    for k in ("mask per token", "json answer (grammar)", "plain answer"):
        print(f"| {k} | {1000 * med[k]:.2f} |")
    print(json.dumps({k: [round(x * 1000, 3) for x in v] for k, v in times.items()}))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
