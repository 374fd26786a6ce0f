"""llguidance against xgrammar for response_format (issue N.3: "pick by measurement"), side by side on
the default model's tokenizer (Gemma 3: 262,144 tokens).

    .venv/bin/pip install --no-deps xgrammar apache-tvm-ffi     # once; kvfuse itself uses llguidance
    .venv/bin/python benchmarks/grammar_libs.py [--rounds 5]

For each library: compiling the tokenizer once, compiling the JSON schema of `grammar_mask.py`, and the
per-token cost of decoding under it: the mask for the state (filled into the library's bitmask) and
taking the token, along a valid answer's tokens. Interleaved, one of each per round; medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name  # noqa: E402
from grammar_mask import SCHEMA  # noqa: E402

ANSWER = '{"days":30,"annual":false,"plan":"the monthly plan"}'


def llguidance_lib(hf: Any) -> tuple[float, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf)
    setup = time.perf_counter() - t
    defaults = {"whitespace_flexible": False}

    def run(ids: list[int]) -> tuple[float, float]:
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=defaults)
        matcher = llguidance.LLMatcher(tok, grammar)
        bits = llguidance.torch.allocate_token_bitmask(1, tok.vocab_size)
        compiled = time.perf_counter() - t
        t = time.perf_counter()
        for i in ids:
            llguidance.torch.fill_next_token_bitmask(matcher, bits, 0)
            assert matcher.consume_token(i)
        return compiled, (time.perf_counter() - t) / len(ids)

    return setup, run


def xgrammar_lib(hf: Any) -> tuple[float, Any]:
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t

    def run(ids: list[int]) -> tuple[float, float]:
        t = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                              separators=(",", ":")))
        bits = xgr.allocate_token_bitmask(1, info.vocab_size)
        compiled = time.perf_counter() - t
        t = time.perf_counter()
        for i in ids:
            matcher.fill_next_token_bitmask(bits, 0)
            assert matcher.accept_token(i)
        return compiled, (time.perf_counter() - t) / len(ids)

    return setup, run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.text import Tokenizer

    tok = Tokenizer(resolve_model_path(None))
    ids = tok.encode(ANSWER)
    libs = {name: make(tok.hf) for name, make in (("llguidance", llguidance_lib), ("xgrammar", xgrammar_lib))}
    for _, run in libs.values():
        run(ids)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in libs}
    for _ in range(args.rounds):
        for name, (_, run) in libs.items():
            times[name].append(run(ids))
    import importlib.metadata as md

    print(f"\n{cpu_name()}; {len(tok.hf)}-token vocabulary; {len(ids)} answer tokens; {args.rounds} interleaved "
          f"rounds; llguidance {md.version('llguidance')}, xgrammar {md.version('xgrammar')}\n")
    print("| library | tokenizer, once (s) | schema compile (ms) | mask + take, per token (ms) |")
    print("|---|---|---|---|")
    for name, (setup, _) in libs.items():
        compile_ms = statistics.median(c for c, _ in times[name]) * 1e3
        token_ms = statistics.median(p for _, p in times[name]) * 1e3
        print(f"| {name} | {setup:.2f} | {compile_ms:.2f} | {token_ms:.3f} |")


if __name__ == "__main__":
    main()
