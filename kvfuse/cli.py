"""The `kvfuse` command line. Thin: it parses flags and calls the library."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RATIO_HELP = "blend's recompute ratio, between 0 and 1 (default 0.15)"


def _ratio(value: str) -> float:
    try:
        r = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ratio takes a number between 0 and 1, got {value!r}") from None
    if not 0.0 <= r <= 1.0:
        raise argparse.ArgumentTypeError(f"--ratio must be between 0 and 1, got {value}")
    return r


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SystemExit(f"kvfuse: cannot read {flag} {path}: {e.strerror}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfuse", description="Answer questions over knowledge with almost no prefill.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer a question over a prefix and chunks in one of four modes")
    g.add_argument("--model", default=None, help="local HF checkpoint dir (default: Gemma 3 270M, converted once)")
    g.add_argument("--prefix-file", help="text placed after the instruction head, cached as a prefix")
    g.add_argument("--chunk-file", action="append", default=[], help="a chunk's text file (repeatable, in order)")
    g.add_argument("--question", required=True, help="the question (the never-cached suffix)")
    g.add_argument("--mode", choices=["full", "prefix", "reuse", "blend"], default="blend")
    g.add_argument("--ratio", type=_ratio, default=None, help=RATIO_HELP)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: newline)")
    g.add_argument("--json", action="store_true", help="print one JSON object")

    d = sub.add_parser("demo", help="answer a bundled question with full and blend, and compare TTFT")
    d.add_argument("--model", default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "demo":
        return cmd_demo(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


def cmd_generate(args: argparse.Namespace) -> int:
    from kvfuse.engine import Engine, ModeUnavailableError, RequestError
    from kvfuse.sampling import SamplingParams
    from kvfuse.text import DEFAULT_STOP, Prompt, Tokenizer, complete_text

    prompt = Prompt(
        prefix_text=_read(args.prefix_file, "--prefix-file") if args.prefix_file else None,
        chunks=tuple(_read(f, "--chunk-file") for f in args.chunk_file),
        question=args.question,
    )
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
    except ValueError as e:
        raise SystemExit(f"kvfuse: {e}") from None
    engine = Engine.load(args.model)
    tok = Tokenizer(engine_path(engine, args.model))
    req = prompt.request(tok, prefix_mode=args.mode == "prefix")
    try:
        precompute_s = engine.precompute(req, args.mode)
        stream = engine.stream(req, args.mode, args.ratio, params)
        answer = complete_text(stream, tok, args.stop or DEFAULT_STOP).strip()
    except (RequestError, ModeUnavailableError) as e:
        raise SystemExit(f"kvfuse: {e}") from None
    result = stream.result
    assert result is not None
    out: dict[str, Any] = {
        "answer": answer,
        "mode": args.mode,
        "ratio": result.ratio,
        "ttft_s": round(result.ttft_s, 6),
        "precompute_s": round(precompute_s, 6),
        "tokens": result.counts.as_dict(),
        "first_token_top": [[i, round(lp, 6)] for i, lp in result.first_token_top(20)],
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(answer)
        print(f"[{args.mode}] ttft {result.ttft_s:.3f}s, tokens {result.counts.as_dict()}", file=sys.stderr)
    return 0


def engine_path(engine: Any, model: str | None) -> Path:
    from kvfuse.weights import resolve_model_path

    return resolve_model_path(model)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvfuse.demo import run_demo

    return run_demo(args.model)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
