"""`kvfuse serve`: the HTTP server."""

from __future__ import annotations

import argparse
import sys

from kvfuse.cli.args import budget_flags, byte_size, model_flag, redis_flags, remote
from kvfuse.server.worker import DEFAULT_MAX_ITL_FACTOR  # a light import: no torch, no FastAPI


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, knowledge bases)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    model_flag(s)
    s.add_argument("--kb", action="append", default=[], help="knowledge-base dir, served under its name (repeatable; "
                                                             "albaran is the bundled demo)")
    s.add_argument("--store", default=None, help="KV store directory (default: the user cache dir)")
    s.add_argument("--keys", default=None, help="TOML file of API keys, tenants and their knowledge-base groups")
    s.add_argument("--max-queue", type=int, default=16, help="requests waiting or running before 429")
    s.add_argument("--max-batch", type=int, default=8,
                   help="requests that decode together, one token each per step (1: one request at a time)")
    s.add_argument("--max-documents", type=int, default=16, help="documents per request")
    s.add_argument("--max-document-tokens", type=int, default=4096, help="tokens per document")
    s.add_argument("--max-itl-factor", type=float, default=DEFAULT_MAX_ITL_FACTOR,
                   help="while a request prefills, running streams get a token at least every FACTOR usual steps "
                        "(1: they never wait; larger: the newcomer's first token comes sooner)")
    s.add_argument("--max-body-bytes", type=byte_size, default=None,
                   help="the largest request body taken, checked before it is parsed (413 past it; default: "
                        "16 bytes per token of the window plus the documents allowed)")
    s.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without a key (with --keys it otherwise needs one)")
    budget_flags(s)
    redis_flags(s)
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=cmd_serve)


def build_state(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The server's state: its engine, tokenizer, knowledge bases and worker, built on a thread that
    ends, so that the model thread's is the process's only OpenMP team (`worker.on_passing_thread`)."""
    from kvfuse.server.worker import on_passing_thread

    return on_passing_thread(lambda: _build_state(args))


def _build_state(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from kvfuse.kb.base import KnowledgeBase
    from kvfuse.kb.manifest import KBError, load_manifest
    from kvfuse.runtime import attach_controller, open_engine, store_dir
    from kvfuse.server.auth import Keys, KeysError
    from kvfuse.server.state import Limits, ServerState

    if min(args.max_queue, args.max_batch, args.max_documents, args.max_document_tokens) < 1:
        raise SystemExit("kvfuse: --max-queue, --max-batch, --max-documents and --max-document-tokens must be at "
                         "least 1")
    if not args.max_itl_factor >= 1.0:
        raise SystemExit(f"kvfuse: --max-itl-factor must be at least 1, got {args.max_itl_factor}")
    try:
        keys = Keys.load(args.keys) if args.keys else None
        manifests = [load_manifest(k) for k in args.kb]
    except (KeysError, KBError) as e:
        raise SystemExit(f"kvfuse: {e}") from None
    names = [m.name for m in manifests]
    if len(set(names)) != len(names):
        raise SystemExit(f"kvfuse: two --kb directories have the same name ({', '.join(names)})")
    store = store_dir(args.store)
    rt = open_engine(args.model, store, precision=args.precision,
                     capacity={"memory": args.memory_bytes, "disk": args.disk_bytes}, remote=remote(args),
                     device=args.device)
    attach_controller(rt.engine, store)  # ratio "auto" over HTTP; the profile is measured once and kept
    # the grammar library compiles against transformers' tokenizer (`Tokenizer.hf`): read now, not on the
    # planner thread at the first response_format, where loading transformers would hold the GIL for
    # seconds while streams and /health wait
    _ = rt.tok.hf
    kbs = {m.name: KnowledgeBase(rt.engine, rt.tok, m, state_dir=store) for m in manifests}
    if kbs:  # the conflict check's indexes, built beside the start rather than inside the first answer
        import threading

        from kvfuse.kb.conflicts import warm

        def warm_all() -> None:
            for kb in kbs.values():
                warm(kb)

        threading.Thread(target=warm_all, name="kvfuse-warm-conflicts", daemon=True).start()
    limits = Limits(args.max_documents, args.max_document_tokens, args.max_queue, args.max_batch,
                    args.max_itl_factor, args.max_body_bytes, args.metrics_public)
    return ServerState(rt.engine, rt.tok, rt.model_id, kbs, keys, limits)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvfuse.server.app import create_app

    state = build_state(args)
    print(f"kvfuse: serving {state.model_id} on http://{args.host}:{args.port}/v1 "
          f"(knowledge bases: {', '.join(state.kbs) or 'none'}; auth: {'on' if state.keys else 'off'})",
          file=sys.stderr, flush=True)
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level)
    return 0
