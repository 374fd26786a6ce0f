"""`kvfuse eval`, `kvfuse eval deviation` and `kvfuse eval make-crosschunk`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvfuse.cli.args import model_flag

DEFAULT_METHODS = "full,prefix,reuse,blend@0.15,legolink@16,default"


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
                   help="comma-separated: default, full, prefix, reuse, blend@R, blend@auto, legolink@K, "
                        "queryaware@R, mapreduce, maprerank; a fuser takes its options as NAME@R:OPTION=VALUE "
                        "(queryaware@0.2:behind=bos)")
    e.add_argument("--top-k", type=int, default=6, help="chunks kept per case")
    e.add_argument("--chunk-tokens", type=int, default=512, help="chunk size limit in tokens")
    e.add_argument("--max-tokens", type=int, default=32, help="answer length limit")
    e.add_argument("--out", help="output directory (eval, deviation) or file (make-crosschunk)")
    model_flag(e)
    e.add_argument("--ratios", default="0.05,0.1,0.15,0.2,0.3,0.5", help="deviation: the ratios to sweep")
    e.add_argument("--n", type=int, default=60, help="make-crosschunk: number of cases")
    e.add_argument("--seed", type=int, default=0, help="make-crosschunk: random seed")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(func=cmd_eval)

    c = sub.add_parser("calibrate", help="measure each fuser's fidelity against cost on this model; ratio auto's "
                                         "floor becomes the smallest ratio that reaches the target")
    model_flag(c)
    c.add_argument("--cases", type=int, default=8, help="calibration cases, generated (never the eval data)")
    c.add_argument("--seed", type=int, default=None, help="the calibration set's seed (default: its own, 1234)")
    c.add_argument("--fusers", default="blend,queryaware",
                   help="comma-separated fusers that take a ratio, with options if any (queryaware:behind=head)")
    c.add_argument("--ratios", default="0.05,0.1,0.15,0.2,0.3,0.5")
    c.add_argument("--target-kl", type=float, default=None, help="the fidelity target (default 0.02)")
    c.add_argument("--answer-tokens", type=int, default=32,
                   help="tokens of full's answer teacher-forced (default: the eval's answer length)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_calibrate)


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
    engine, tok, name = _engine(args.model, args.precision, args.device)
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

    if any(m.name.endswith("@auto") or m.name == "default" for m in methods):
        from kvfuse.checkpoints import cache_dir
        from kvfuse.profile import load_calibration
        from kvfuse.runtime import attach_controller

        # `default` uses the calibrated ratio when this model was calibrated (the controller holds it, and
        # needs a profile: measured now if this machine has none)
        calibrated = load_calibration(cache_dir(), engine.fingerprint) is not None
        attach_controller(engine, None, measure=calibrated or any(m.name.endswith("@auto") for m in methods))
    settings = EvalSettings(args.top_k, args.chunk_tokens, args.max_tokens)
    results = run_eval(engine, tok, cases, methods, settings, name, str(args.data), progress=not args.quiet)
    paths = write_outputs(results, out)
    summary = {n: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}
               for n, m in results["methods"].items()}
    print(json.dumps({"out": str(out), "files": [p.name for p in paths], "methods": summary}))
    return 0


def _engine(model: str | None, precision: str, device: str):  # type: ignore[no-untyped-def]
    from kvfuse.runtime import open_engine

    print(f"loading {model or 'the default model'} ({precision}, {device})", file=sys.stderr, flush=True)
    rt = open_engine(model, None, precision=precision, device=device)
    return rt.engine, rt.tok, rt.model_id



def _crosschunk(args: argparse.Namespace) -> int:
    _need(args, "out")
    if args.n <= 0:
        raise SystemExit("kvfuse: --n must be a positive number of cases")
    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.eval.crosschunk import make_cases
    from kvfuse.text import Tokenizer

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


def cmd_calibrate(args: argparse.Namespace) -> int:
    from kvfuse.checkpoints import cache_dir
    from kvfuse.eval.calibrate import DEFAULT_SEED, calibrate
    from kvfuse.eval.crosschunk import make_cases
    from kvfuse.eval.data import cases_from
    from kvfuse.fuse import FUSERS, Fuser, parse_fuser
    from kvfuse.policy import DEFAULT_TARGET_KL
    from kvfuse.profile import load_calibration, save_calibration

    known = ", ".join(n for n, f in FUSERS.items() if f.takes_ratio)
    fusers: list[Fuser] = []
    for spec in (f.strip() for f in args.fusers.split(",")):
        if not spec:
            continue
        try:
            fuser = parse_fuser(spec)
        except ValueError as e:
            raise SystemExit(f"kvfuse: --fusers: {e}") from None
        if not fuser.takes_ratio:
            raise SystemExit(f"kvfuse: --fusers takes fusers that use a ratio ({known}), got {spec!r}")
        fusers.append(fuser)
    if not fusers:
        raise SystemExit(f"kvfuse: --fusers takes fusers that use a ratio ({known}), got {args.fusers!r}")
    try:
        ratios = sorted({float(r) for r in args.ratios.split(",") if r.strip()})
    except ValueError:
        raise SystemExit(f"kvfuse: --ratios takes numbers like 0.05,0.15, got {args.ratios!r}") from None
    if not ratios or not all(0.0 <= r <= 1.0 for r in ratios):
        raise SystemExit("kvfuse: --ratios must be numbers between 0 and 1")
    target = DEFAULT_TARGET_KL if args.target_kl is None else args.target_kl
    if target <= 0 or args.cases <= 0 or args.answer_tokens <= 0:
        raise SystemExit("kvfuse: --target-kl, --cases and --answer-tokens must be positive")
    engine, tok, name = _engine(args.model, args.precision, args.device)
    seed = DEFAULT_SEED if args.seed is None else args.seed
    cases = cases_from(make_cases(args.cases, seed, lambda text: len(tok.encode(text))), "the calibration set")
    cal = calibrate(engine, tok, cases, fusers, ratios, target, args.answer_tokens, seed, progress=not args.quiet)
    cal, kept = cal.keeping(load_calibration(cache_dir(), engine.fingerprint))  # other fusers' curves stay
    path = save_calibration(cal, cache_dir())
    print(json.dumps({"model": name, "out": str(path), "target_kl": target, "cases": len(cases), "seed": seed,
                      "kept": kept,
                      "floors": {f: cal.floor(f) for f in cal.curves},
                      "reaches_target": {f: cal.reaches_target(f) for f in cal.curves},
                      "curves": cal.to_json()["curves"]}))
    return 0
