"""`kvfuse generate`, `precompute`, `profile`, `store` and `demo`: the engine's own commands."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvfuse.cli.args import RATIO_HELP, fail, model_flag, ratio, read, remote, store_flag, store_flags
from kvfuse.runtime import DEFAULT_FLOOR, attach_controller, open_engine, store_dir


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvfuse.defaults import BUILTIN_MODES, DEFAULT_MODE

    g = sub.add_parser("generate", help="answer a question over a prefix and chunks in one of the modes")
    model_flag(g)
    g.add_argument("--prefix-file", help="text placed after the instruction head, cached as a prefix")
    g.add_argument("--chunk-file", action="append", default=[], help="a chunk's text file (repeatable, in order)")
    g.add_argument("--question", required=True, help="the question (the never-cached suffix)")
    g.add_argument("--mode", default=DEFAULT_MODE, help=f"a registered fuser: {', '.join(BUILTIN_MODES)} or an "
                   f"extension's (default: {DEFAULT_MODE})")
    g.add_argument("--ratio", type=ratio, default=None, help=RATIO_HELP)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: newline)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--floor", type=float, default=DEFAULT_FLOOR, help="the controller's quality floor for --ratio auto")
    store_flags(g)
    g.set_defaults(func=cmd_generate)

    pc = sub.add_parser("precompute", help="compute chunk caches into the store ahead of time")
    model_flag(pc)
    pc.add_argument("--chunk-file", action="append", required=True, help="a chunk's text file (repeatable)")
    store_flags(pc)
    pc.set_defaults(func=cmd_precompute)

    pr = sub.add_parser("profile", help="measure (once) prefill and tier costs for the loading controller")
    model_flag(pr)
    pr.add_argument("--json", action="store_true", help="print one JSON object")
    pr.add_argument("--refresh", action="store_true", help="measure again even if a profile is saved")
    pr.add_argument("--tokens", type=int, default=3400, help="request size the recommendation is for")
    pr.add_argument("--floor", type=float, default=DEFAULT_FLOOR, help="the quality floor of the recompute ratio")
    pr.add_argument("--cost", action="append", default=[], metavar="TIER=COST",
                    help="storage cost per GB of a tier (repeatable; defaults memory=4 disk=0.1)")
    store_flags(pr)
    pr.set_defaults(func=cmd_profile)

    st = sub.add_parser("store", help="inspect or manage a KV store directory")
    st.add_argument("action", choices=["stats", "verify", "clear"])
    st.add_argument("--repair", action="store_true",
                    help="verify: drop the damaged entries it finds (it exits 1 whenever it finds any)")
    store_flag(st)
    st.set_defaults(func=cmd_store)

    d = sub.add_parser("demo", help="the Albarán demo: CAG from a persisted cache, then the hybrid with a ticket")
    model_flag(d)
    store_flag(d)
    d.set_defaults(func=cmd_demo)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvfuse.engine.sampling import SamplingParams
    from kvfuse.fuse import FUSERS
    from kvfuse.request import ModeUnavailableError, RequestError
    from kvfuse.text import DEFAULT_STOP, Prompt, complete_answer

    if args.mode not in FUSERS:  # checked here, not by the parser: extensions register fusers too
        raise fail(ValueError(f"unknown mode {args.mode!r}; choose one of {', '.join(FUSERS)}"))
    prompt = Prompt(
        prefix_text=read(args.prefix_file, "--prefix-file") if args.prefix_file else None,
        chunks=tuple(read(f, "--chunk-file") for f in args.chunk_file),
        question=args.question,
    )
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
    except ValueError as e:
        raise fail(e) from None
    where = store_dir(args.store, args.no_store)
    rt = open_engine(args.model, where, args.kv_dtype, args.precision, remote=remote(args), device=args.device,
                     decodes="few")
    engine, tok = rt.engine, rt.tok
    attach_controller(engine, where, FUSERS[args.mode].takes_ratio, args.floor)
    req = prompt.request(tok, prefix_mode=args.mode == "prefix")
    try:
        precompute_s = engine.precompute(req, args.mode)
        stream = engine.stream(req, args.mode, args.ratio, params)
        answer = complete_answer(stream, tok, args.stop or DEFAULT_STOP).text
    except (RequestError, ModeUnavailableError) as e:
        raise fail(e) from None
    finally:
        engine.store.flush()  # written back to disk before the process ends
    result = stream.result
    assert result is not None
    out: dict[str, Any] = {
        "answer": answer,
        "mode": args.mode,
        "fuser": result.fuser,
        "ratio": result.ratio,
        "precision": engine.precision,
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

    from kvfuse.fuse import DEFAULT_MODE, residual_layer
    from kvfuse.text import Prompt

    texts = [read(f, "--chunk-file") for f in args.chunk_file]
    where = store_dir(args.store, args.no_store)
    rt = open_engine(args.model, where, args.kv_dtype, args.precision, remote=remote(args), device=args.device,
                     decodes="none")
    req = Prompt(chunks=tuple(texts), question="-").request(rt.tok)
    t0, computed = time.perf_counter(), 0
    # behind what the default mode's caches are computed behind (a copy of the chunk, for queryaware)
    fuser = rt.engine.fuser(DEFAULT_MODE)
    behind, residual = rt.engine.cache.chunk_preambles(fuser, req), residual_layer(fuser)
    for chunk, pre in tqdm(list(zip(req.chunks, behind, strict=True)), desc="precomputing chunk caches", unit="chunk"):
        computed += int(not rt.engine.cache.chunk_cache(chunk, None, pre, residual)[1])
    rt.engine.store.flush()
    print(json.dumps({"chunks": len(req.chunks), "computed": computed, "already_cached": len(req.chunks) - computed,
                      "seconds": round(time.perf_counter() - t0, 3), "store": str(where)}))
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    from kvfuse.store import DiskTier

    root = store_dir(args.store)
    assert root is not None
    if not root.is_dir() and args.action != "clear":
        raise SystemExit(f"kvfuse: no store at {root}; pass --store DIR")
    tier = DiskTier(root)
    if args.action == "stats":
        out: dict[str, Any] = {"store": str(root), "entries": len(tier), "bytes": tier.used_bytes,
                               "capacity_bytes": tier.capacity_bytes}
    elif args.action == "verify":
        results = list(tier.verify(repair=args.repair))
        bad = [{"key": k, "error": e} for k, e in results if e]
        out = {"store": str(root), "checked": len(results), "ok": len(results) - len(bad), "corrupt": bad,
               "dropped": len(bad) if args.repair else 0}
        print(json.dumps(out))
        if bad:  # a script or a cron job notices
            hint = "dropped them" if args.repair else "run it again with --repair to drop them"
            print(f"kvfuse: {len(bad)} damaged entr{'y' if len(bad) == 1 else 'ies'} in {root}; {hint}",
                  file=sys.stderr)
            return 1
        return 0
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


def cmd_profile(args: argparse.Namespace) -> int:
    from kvfuse.checkpoints import cache_dir
    from kvfuse.policy import Controller
    from kvfuse.profile import load_or_profile

    if not 0.0 <= args.floor <= 1.0:
        raise SystemExit(f"kvfuse: --floor must be between 0 and 1, got {args.floor}")
    costs = _costs(args.cost)
    where = store_dir(args.store, args.no_store)
    engine = open_engine(args.model, where, args.kv_dtype, args.precision, remote=remote(args),
                         device=args.device).engine
    prof = load_or_profile(engine, cache_dir(), where, refresh=args.refresh, costs=costs)
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

    return run_demo(args.model, args.store, args.precision, args.device)
