"""`kvfuse eval`, `kvfuse eval deviation` and `kvfuse eval make-crosschunk`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_METHODS = "full,prefix,reuse,blend@0.15,legolink@16"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    e = sub.add_parser(
        "eval", help="evaluate methods on QA data; also: eval deviation, eval make-crosschunk",
        description="kvfuse eval --data FILE --methods LIST --out DIR;  kvfuse eval deviation --data FILE --out DIR;"
                    "  kvfuse eval make-crosschunk --n N --seed S --out FILE",
    )
    e.add_argument("action", nargs="?", choices=["deviation", "make-crosschunk"],
                   help="omit to run the evaluation itself")
    e.add_argument("--data", help="JSON list of {ctxs: [{title, text}], question, answers}")
    e.add_argument("--cases", type=int, default=None, help="how many cases (default: all)")
    e.add_argument("--offset", type=int, default=0, help="skip this many cases first")
    e.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated: full, prefix, reuse, blend@R, blend@auto, legolink@K, mapreduce, maprerank")
    e.add_argument("--top-k", type=int, default=6, help="chunks kept per case")
    e.add_argument("--chunk-tokens", type=int, default=512, help="chunk size limit in tokens")
    e.add_argument("--max-tokens", type=int, default=32, help="answer length limit")
    e.add_argument("--out", help="output directory (eval, deviation) or file (make-crosschunk)")
    e.add_argument("--model", default=None, help="local HF checkpoint dir (default: Gemma 3 270M)")
    e.add_argument("--ratios", default="0.05,0.1,0.15,0.2,0.3,0.5", help="deviation: the ratios to sweep")
    e.add_argument("--n", type=int, default=60, help="make-crosschunk: number of cases")
    e.add_argument("--seed", type=int, default=0, help="make-crosschunk: random seed")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(func=cmd_eval)


def _need(args: argparse.Namespace, *names: str) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) in (None, "")]
    if missing:
        what = f"eval {args.action}" if args.action else "eval"
        raise SystemExit(f"kvfuse: {what} needs {', '.join(missing)}")


def cmd_eval(args: argparse.Namespace) -> int:
    if args.action == "make-crosschunk":
        return _crosschunk(args)
    _need(args, "data", "out")
    for flag in ("top_k", "chunk_tokens", "max_tokens"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"kvfuse: --{flag.replace('_', '-')} must be a positive number")
    from kvfuse.eval.data import DataError, load_cases
    from kvfuse.eval.methods import parse_methods

    try:
        cases = load_cases(args.data, args.cases, args.offset)
        methods = parse_methods(args.methods) if args.action is None else []
    except (DataError, ValueError) as e:
        raise SystemExit(f"kvfuse: {e}") from None
    engine, tok, name = _engine(args.model)
    out = Path(args.out)
    if args.action == "deviation":
        from kvfuse.eval.deviation import run_deviation

        try:
            ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
        except ValueError:
            raise SystemExit(f"kvfuse: --ratios takes numbers like 0.05,0.15, got {args.ratios!r}") from None
        if not ratios or not all(0.0 < r <= 1.0 for r in ratios):
            raise SystemExit("kvfuse: --ratios must be numbers in (0, 1]")
        result = run_deviation(engine, tok, cases, ratios, args.top_k, args.chunk_tokens, out, not args.quiet)
        print(json.dumps({"out": str(out), "files": result["files"]}))
        return 0
    from kvfuse.eval.harness import EvalSettings, run_eval, write_outputs

    if any(m.name == "blend@auto" for m in methods):
        from kvfuse.runtime import attach_controller

        attach_controller(engine, None)
    settings = EvalSettings(args.top_k, args.chunk_tokens, args.max_tokens)
    results = run_eval(engine, tok, cases, methods, settings, name, str(args.data), progress=not args.quiet)
    paths = write_outputs(results, out)
    summary = {n: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}
               for n, m in results["methods"].items()}
    print(json.dumps({"out": str(out), "files": [p.name for p in paths], "methods": summary}))
    return 0


def _engine(model: str | None):  # type: ignore[no-untyped-def]
    from kvfuse.runtime import open_engine

    print(f"loading {model or 'the default model'}", file=sys.stderr, flush=True)
    rt = open_engine(model, None)
    return rt.engine, rt.tok, rt.model_id



def _crosschunk(args: argparse.Namespace) -> int:
    _need(args, "out")
    if args.n <= 0:
        raise SystemExit("kvfuse: --n must be a positive number of cases")
    from kvfuse.eval.crosschunk import make_cases
    from kvfuse.text import Tokenizer
    from kvfuse.weights import resolve_model_path

    tok = Tokenizer(resolve_model_path(args.model))  # passages are sized in this model's tokens
    cases = make_cases(args.n, args.seed, lambda text: len(tok.encode(text)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cases, indent=1), encoding="utf-8")
    kinds: dict[str, int] = {}
    for c in cases:
        kinds[c["kind_of_question"]] = kinds.get(c["kind_of_question"], 0) + 1
    print(json.dumps({"out": str(out), "cases": len(cases), "kinds": kinds}))
    return 0
