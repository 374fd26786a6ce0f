"""`kvfuse cluster up`: Redis (if asked), N replicas of `kvfuse serve` and SMG in front, on one machine."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from kvfuse.cli.args import model_flag


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    c = sub.add_parser("cluster", help="replicas of kvfuse serve behind the SMG router, sharing a Redis tier")
    c.add_argument("action", choices=["up"])
    c.add_argument("--replicas", type=int, default=2, help="kvfuse serve processes (default 2)")
    c.add_argument("--redis", default=None, metavar="URL", help="the shared Redis (redis://HOST:PORT/DB)")
    c.add_argument("--start-redis", action="store_true",
                   help="start a redis-server on a free loopback port (no persistence, LRU) instead of --redis")
    c.add_argument("--host", default="127.0.0.1", help="the router's address")
    c.add_argument("--port", type=int, default=8000, help="the router's port (replicas take free ports)")
    model_flag(c)
    c.add_argument("--kb", action="append", default=[], help="knowledge-base dir every replica serves (repeatable)")
    c.add_argument("--keys", default=None, help="TOML file of API keys, for every replica")
    c.add_argument("--store", default=None,
                   help="root of the replicas' store directories (replica-0, replica-1, …; default: the user "
                        "cache dir's cluster/)")
    c.set_defaults(func=cmd_cluster)


def cmd_cluster(args: argparse.Namespace) -> int:
    from kvfuse.checkpoints import cache_dir
    from kvfuse.cluster import cluster
    from kvfuse.store.redis import check_url

    if args.replicas < 1:
        raise SystemExit("kvfuse: --replicas must be at least 1")
    if bool(args.redis) == bool(args.start_redis):
        raise SystemExit("kvfuse: give --redis URL (a running Redis) or --start-redis (one started here)")
    try:
        url = check_url(args.redis) if args.redis else None
    except ValueError as e:
        raise SystemExit(f"kvfuse: {e}") from None
    serve_args = ["--model", args.model] if args.model else []
    serve_args += ["--precision", args.precision, "--device", args.device, "--log-level", "warning"]
    for kb in args.kb:
        serve_args += ["--kb", kb]
    if args.keys:
        serve_args += ["--keys", args.keys]
    root = Path(args.store) if args.store else cache_dir() / "cluster"
    root.mkdir(parents=True, exist_ok=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        with cluster(args.replicas, serve_args, url, args.port, root, logs=root, host=args.host) as c:
            print(f"kvfuse: {len(c.replicas)} replicas ({', '.join(r.url for r in c.replicas)}) behind SMG on "
                  f"http://{args.host}:{args.port}/v1, sharing {c.redis_url}; logs in {root}; Ctrl-C stops them",
                  file=sys.stderr, flush=True)
            done.wait()
    except RuntimeError as e:
        raise SystemExit(f"kvfuse: {e}") from None
    return 0
