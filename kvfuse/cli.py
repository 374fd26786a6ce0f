"""The `kvfuse` command line. Thin: it parses flags and calls the library."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RATIO_HELP = "blend's recompute ratio, between 0 and 1 (default 0.15), or auto (the loading controller)"


def _ratio(value: str) -> float | str:
    from kvfuse.engine import parse_ratio

    try:
        return parse_ratio(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--ratio: {e}") from None


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
    g.add_argument("--mode", choices=["full", "prefix", "reuse", "blend", "legolink"], default="blend")
    g.add_argument("--ratio", type=_ratio, default=None, help=RATIO_HELP)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: newline)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--floor", type=float, default=0.15, help="the controller's quality floor for --ratio auto")
    _store_flags(g)

    pc = sub.add_parser("precompute", help="compute chunk caches into the store ahead of time")
    pc.add_argument("--model", default=None)
    pc.add_argument("--chunk-file", action="append", required=True, help="a chunk's text file (repeatable)")
    _store_flags(pc)

    pr = sub.add_parser("profile", help="measure (once) prefill and tier costs for the loading controller")
    pr.add_argument("--model", default=None)
    pr.add_argument("--json", action="store_true", help="print one JSON object")
    pr.add_argument("--refresh", action="store_true", help="measure again even if a profile is saved")
    pr.add_argument("--tokens", type=int, default=3400, help="request size the recommendation is for")
    pr.add_argument("--floor", type=float, default=0.15, help="the quality floor of the recompute ratio")
    pr.add_argument("--cost", action="append", default=[], metavar="TIER=COST",
                    help="storage cost per GB of a tier (repeatable; defaults memory=4 disk=0.1)")
    _store_flags(pr)

    st = sub.add_parser("store", help="inspect or manage a KV store directory")
    st.add_argument("action", choices=["stats", "verify", "clear"])
    st.add_argument("--store", default=None, help="store directory (default: the user cache dir)")

    from kvfuse.eval.cli import register as register_eval

    register_eval(sub)
    from kvfuse.kb.cli import register as register_kb

    register_kb(sub)
    from kvfuse.server.cli import register as register_serve

    register_serve(sub)

    d = sub.add_parser("demo", help="the Albarán demo: CAG from a persisted cache, then the hybrid with a ticket")
    d.add_argument("--model", default=None)
    d.add_argument("--store", default=None, help="KV store directory (default: the user cache dir)")
    return p


def _store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None, help="KV store directory (default: the user cache dir)")
    p.add_argument("--no-store", action="store_true", help="keep caches in memory only")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="fp32", help="dtype of stored KV caches")


KV_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _store_dir(args: argparse.Namespace) -> Path | None:
    from kvfuse.weights import cache_dir

    if getattr(args, "no_store", False):
        return None
    return Path(args.store) if args.store else cache_dir() / "store"


def _load_engine(args: argparse.Namespace) -> Any:
    import torch

    from kvfuse.engine import Engine

    dtype = getattr(torch, KV_DTYPES[args.kv_dtype])
    return Engine.load(args.model, store_dir=_store_dir(args), kv_dtype=dtype)


def main(argv: Sequence[str] | None = None) -> int:
    from kvfuse.config import CheckpointError, UnsupportedModelError

    args = build_parser().parse_args(argv)
    commands = {"generate": cmd_generate, "demo": cmd_demo, "precompute": cmd_precompute, "store": cmd_store,
                "profile": cmd_profile}
    try:
        return int(args.func(args)) if hasattr(args, "func") else commands[args.command](args)
    except (CheckpointError, UnsupportedModelError) as e:  # a bad --model, for every command
        raise SystemExit(f"kvfuse: {e}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from kvfuse.engine import ModeUnavailableError, RequestError
    from kvfuse.sampling import SamplingParams
    from kvfuse.text import DEFAULT_STOP, Prompt, Tokenizer, complete_text
    from kvfuse.weights import resolve_model_path

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
    engine = _load_engine(args)
    attach_controller(engine, _store_dir(args), args.mode == "blend", args.floor, _costs(getattr(args, "cost", [])))
    tok = Tokenizer(resolve_model_path(args.model))
    req = prompt.request(tok, prefix_mode=args.mode == "prefix")
    try:
        precompute_s = engine.precompute(req, args.mode)
        stream = engine.stream(req, args.mode, args.ratio, params)
        answer = complete_text(stream, tok, args.stop or DEFAULT_STOP).strip()
    except (RequestError, ModeUnavailableError) as e:
        raise SystemExit(f"kvfuse: {e}") from None
    finally:
        engine.store.flush()  # written back to disk before the process ends
    result = stream.result
    assert result is not None
    out: dict[str, Any] = {
        "answer": answer,
        "mode": args.mode,
        "ratio": result.ratio,
        "ttft_s": round(result.ttft_s, 6),
        "precompute_s": round(precompute_s, 6),
        "tokens": {k: v for k, v in result.counts.as_dict().items() if k != "cached"},  # the issue-A contract
        "first_token_top": [[i, round(lp, 6)] for i, lp in result.first_token_top(20)],
        "store": result.store.as_dict(),
        "controller": result.controller.as_dict() if result.controller is not None else None,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(answer)
        print(f"[{args.mode}] ttft {result.ttft_s:.3f}s, tokens {result.counts.as_dict()}", file=sys.stderr)
    return 0


def cmd_precompute(args: argparse.Namespace) -> int:
    import time

    from tqdm import tqdm

    from kvfuse.text import Prompt, Tokenizer
    from kvfuse.weights import resolve_model_path

    texts = [_read(f, "--chunk-file") for f in args.chunk_file]
    engine = _load_engine(args)
    tok = Tokenizer(resolve_model_path(args.model))
    req = Prompt(chunks=tuple(texts), question="-").request(tok)
    t0, computed = time.perf_counter(), 0
    for chunk in tqdm(req.chunks, desc="precomputing chunk caches", unit="chunk"):
        computed += int(not engine.chunk_cache(chunk)[1])
    engine.store.flush()
    print(json.dumps({"chunks": len(req.chunks), "computed": computed, "already_cached": len(req.chunks) - computed,
                      "seconds": round(time.perf_counter() - t0, 3), "store": str(_store_dir(args))}))
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    from kvfuse.store import DiskTier

    root = _store_dir(args)
    assert root is not None
    if not root.is_dir() and args.action != "clear":
        raise SystemExit(f"kvfuse: no store at {root}; pass --store DIR")
    tier = DiskTier(root)
    if args.action == "stats":
        out: dict[str, Any] = {"store": str(root), "entries": len(tier), "bytes": tier.used_bytes,
                               "capacity_bytes": tier.capacity_bytes}
    elif args.action == "verify":
        results = list(tier.verify())
        bad = [{"key": k, "error": e} for k, e in results if e]
        out = {"store": str(root), "checked": len(results), "ok": len(results) - len(bad), "corrupt": bad}
    else:
        out = {"store": str(root), "removed": tier.clear()}
    print(json.dumps(out))
    return 0


def _costs(pairs: list[str]) -> dict[str, float]:
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise SystemExit(f"kvfuse: --cost takes TIER=NUMBER, got {pair!r}") from None
    return out


def attach_controller(engine: Any, store_dir: Path | None, measure: bool = True, floor: float = 0.15,
                      costs: dict[str, float] | None = None) -> None:
    """Give the engine a controller from the saved profile (measuring one first if `measure`: blend
    requests always get one, so their results say what the controller predicted)."""
    from kvfuse.controller import Controller, load_or_profile, profile_path
    from kvfuse.weights import cache_dir

    if not measure and not profile_path(cache_dir(), engine.fingerprint).is_file():
        return
    engine.controller = Controller(load_or_profile(engine, cache_dir(), store_dir, costs=costs), floor)


def cmd_profile(args: argparse.Namespace) -> int:
    from kvfuse.controller import Controller, load_or_profile
    from kvfuse.weights import cache_dir

    if not 0.0 <= args.floor <= 1.0:
        raise SystemExit(f"kvfuse: --floor must be between 0 and 1, got {args.floor}")
    engine = _load_engine(args)
    prof = load_or_profile(engine, cache_dir(), _store_dir(args), refresh=args.refresh, costs=_costs(args.cost))
    ctl = Controller(prof, args.floor)
    out = {
        "kv_bytes_per_token": prof.kv_bytes_per_token,
        "prefill_s_per_token": round(prof.prefill_cost(args.tokens), 8),
        "prefill_s_per_token_layer": round(prof.prefill_cost(args.tokens) / engine.cfg.num_layers, 9),
        "prefill_s_per_token_by_length": {str(k): round(v, 8) for k, v in prof.prefill_s_per_token.items()},
        "tiers": {n: {"read_bytes_per_s": round(t.read_bytes_per_s), "cost_per_gb": t.cost_per_gb}
                  for n, t in prof.tiers.items()},
        "tokens": args.tokens,
        "recommended_tier": ctl.recommend_tier(args.tokens),
        "ratio_by_tier": ctl.ratio_by_tier(args.tokens),
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvfuse.demo import run_demo

    return run_demo(args.model, args.store)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
