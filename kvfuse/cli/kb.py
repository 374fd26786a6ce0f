"""`kvfuse kb build|stats`, `kvfuse ask`, `kvfuse compare` and `kvfuse index build`: the knowledge-base commands."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfuse.cli.args import fail as _fail
from kvfuse.cli.args import model_flag, read, redis_flags, remote
from kvfuse.kb.conflicts import answer_lines
from kvfuse.runtime import bundled, open_engine, store_dir

if TYPE_CHECKING:
    from kvfuse.store.base import Remote


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvfuse.defaults import ANSWER_TOKENS
    from kvfuse.rag.index import RETRIEVERS

    kb = sub.add_parser("kb", help="build a knowledge base's cached prefix, or print its stats and daily cost")
    kb.add_argument("action", choices=["build", "stats"])
    kb.add_argument("dir", help="knowledge-base directory (with kb.toml), or albaran for the bundled demo")
    kb.add_argument("--group", default=None, help="access group (default: the one that reads the fewest documents)")
    kb.add_argument("--tenant", default=None, help="tenant whose salt keys the private documents' cache blocks")
    kb.add_argument("--questions-per-day", type=int, default=600, help="stats: questions per day")
    kb.add_argument("--edits-per-day", type=int, default=10, help="stats: document edits per day")
    kb.add_argument("--rag-tokens", type=int, default=2000, help="stats: tokens RAG retrieves per question")
    _common(kb)
    kb.set_defaults(func=cmd_kb)

    a = sub.add_parser("ask", help="answer a question from a knowledge base's cached prefix (and retrieved chunks)")
    a.add_argument("question")
    a.add_argument("--kb", required=True, help="knowledge-base directory, or albaran")
    a.add_argument("--group", default=None)
    a.add_argument("--tenant", default=None)
    a.add_argument("--index", default=None, help="a retrieval index (kvfuse index build): the hybrid, top chunks "
                                                 "fused after the cached prefix (the default mode)")
    a.add_argument("--top-k", type=int, default=2, help="chunks retrieved from --index")
    a.add_argument("--retriever", choices=sorted(RETRIEVERS), default="hybrid")
    a.add_argument("--ratio", default=None, help="the recompute ratio for the fused chunks (or auto)")
    a.add_argument("--max-tokens", type=int, default=ANSWER_TOKENS, help="answer length limit (a sentence with "
                                                                         "a number; JSON says finish_reason)")
    a.add_argument("--no-quote", action="store_true", help="skip the quote request")
    a.add_argument("--json-schema", default=None, metavar="FILE",
                   help="answer as JSON that matches this JSON Schema file (grammar-constrained, as the server's "
                        "response_format); raise --max-tokens for larger objects")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    _common(a)
    a.set_defaults(func=cmd_ask)

    c = sub.add_parser("compare", help="CAG against full prefill and RAG on a question set")
    c.add_argument("--kb", required=True)
    c.add_argument("--questions", required=True, help="JSON list of {question, answers, doc_id?, group?}")
    c.add_argument("--methods", default="cag,full,rag-bm25@4,rag-dense@4,rag-hybrid@4")
    c.add_argument("--group", default=None, help="group for questions that name none")
    c.add_argument("--cases", type=int, default=None, help="only the first N questions")
    c.add_argument("--max-tokens", type=int, default=ANSWER_TOKENS)
    c.add_argument("--no-quote", action="store_true", help="skip the quote requests (no citations)")
    c.add_argument("--out", default=None, help="directory for compare.json, compare.md and compare.png")
    c.add_argument("--json", action="store_true", help="print the summary as JSON")
    _common(c)
    c.set_defaults(func=cmd_compare)

    ix = sub.add_parser("index", help="build a retrieval index (BM25 + dense) over documents")
    ix.add_argument("action", choices=["build"])
    ix.add_argument("src", help="a knowledge-base directory (or albaran), or a directory of .md/.txt files "
                                "(albaran-tickets: the bundled tickets)")
    ix.add_argument("--out", required=True, help="index directory to write")
    ix.add_argument("--chunk-tokens", type=int, default=256)
    ix.add_argument("--overlap", type=int, default=32)
    ix.add_argument("--model", default=None, help="the checkpoint whose tokenizer sizes the chunks")
    ix.set_defaults(func=cmd_index)


def _common(p: argparse.ArgumentParser) -> None:
    model_flag(p)
    p.add_argument("--store", default=None, help="KV store directory (default: the user cache dir)")
    redis_flags(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def open_kb(path: str, model: str | None, store: str | None, precision: str = "fp32",
            shared: Remote | None = None, device: str = "cpu", decodes: str = "many") -> Any:
    from kvfuse.kb.base import KnowledgeBase
    from kvfuse.kb.manifest import KBError, load_manifest

    try:
        manifest = load_manifest(path)  # fail on a bad knowledge base before loading the model
    except KBError as e:
        raise _fail(e) from None
    where = store_dir(store)
    rt = open_engine(model, where, precision=precision, remote=shared, device=device, decodes=decodes)
    return KnowledgeBase(rt.engine, rt.tok, manifest, state_dir=where)


def _group(kb: Any, group: str | None) -> str:
    from kvfuse.kb.manifest import KBError

    g = group or kb.default_group()
    if g not in kb.manifest.groups:
        raise _fail(KBError(f"unknown group {g!r}; {kb.name} has groups {', '.join(kb.manifest.groups)}"))
    return g


def cmd_kb(args: argparse.Namespace) -> int:
    from kvfuse.kb.manifest import KBError

    if args.action == "stats":
        return _stats(args)
    kb = open_kb(args.dir, args.model, args.store, args.precision, remote(args), args.device, decodes="none")
    try:
        report = kb.build(_group(kb, args.group), args.tenant, progress=not args.quiet)
    except KBError as e:
        raise _fail(e) from None
    print(json.dumps(report.as_dict()))
    return 0


def _stats(args: argparse.Namespace) -> int:
    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.kb.cost import CostModel
    from kvfuse.kb.manifest import KBError, load_manifest
    from kvfuse.kb.prefix import plan_prefix
    from kvfuse.kb.usage import Usage
    from kvfuse.text import Tokenizer

    if args.questions_per_day < 0 or args.edits_per_day < 0:
        raise SystemExit("kvfuse: --questions-per-day and --edits-per-day cannot be negative")
    try:
        m = load_manifest(args.dir)
        tok = Tokenizer(resolve_model_path(args.model))
        group = args.group or m.default_group()
        plan = plan_prefix(m, tok, group)
    except KBError as e:
        raise _fail(e) from None
    by_stability: dict[str, int] = {}
    for seg in plan.segments:
        if seg.name != "instructions":
            st = str(m.document(seg.name).stability)
            by_stability[st] = by_stability.get(st, 0) + seg.end - seg.start
    last = max(m.document(s.name).stability for s in plan.segments if s.name != "instructions")
    first_volatile = min(s.start for s in plan.segments if s.name != "instructions"
                         and m.document(s.name).stability == last)
    total = len(plan.ids)
    costs = CostModel()
    writes = 1 + args.edits_per_day  # the morning build, then one rewrite per edit
    seed_style = costs.daily(total, args.questions_per_day, writes, rag_tokens=args.rag_tokens)
    edit_aware = costs.daily(total, args.questions_per_day, writes, rewrite_tokens=total - first_volatile,
                             rag_tokens=args.rag_tokens)
    # the morning build writes everything; edits of the most volatile group rewrite from it to the end
    edit_aware["cag"]["write"] = round((total + args.edits_per_day * (total - first_volatile)) * costs.write, 1)
    edit_aware["cag"]["total"] = round(edit_aware["cag"]["write"] + edit_aware["cag"]["read"], 1)
    where = store_dir(args.store)
    assert where is not None
    usage = Usage(where, m.name).read()
    g = usage.get(group, {})
    out = {
        "kb": m.name, "group": group, "kb_version": plan.version, "documents": len(plan.documents),
        "prefix_tokens": total, "tokens_by_stability": by_stability,
        "questions_per_day": args.questions_per_day, "edits_per_day": args.edits_per_day,
        "cost_units": costs.as_dict(),
        "daily_full_rewrites": seed_style,
        "daily_edit_aware": {**edit_aware, "rewrite_tokens_per_edit": total - first_volatile},
        "cumulative": {"requests": g.get("requests", 0), "prompt_tokens": g.get("prompt_tokens", 0),
                       "cached_tokens": g.get("cached_tokens", 0),
                       "cached_token_share": round(g["cached_tokens"] / g["prompt_tokens"], 4)
                       if g.get("prompt_tokens") else None},
    }
    print(json.dumps(out, indent=1))
    return 0


def _ratio(value: str | None) -> float | str | None:
    from kvfuse.request import parse_ratio

    try:
        return None if value is None else parse_ratio(value)
    except ValueError as e:
        raise SystemExit(f"kvfuse: --ratio: {e}") from None


def cmd_ask(args: argparse.Namespace) -> int:
    from kvfuse.kb.manifest import KBError
    from kvfuse.rag.index import Index, RetrievalIndexError
    from kvfuse.request import ModeUnavailableError, RequestError
    from kvfuse.runtime import attach_controller

    ratio = _ratio(args.ratio)
    if args.top_k <= 0 or args.max_tokens <= 0:
        raise SystemExit("kvfuse: --top-k and --max-tokens must be positive")
    index = None
    if args.index:
        try:
            index = Index.load(args.index)
        except RetrievalIndexError as e:
            raise _fail(e) from None
    schema = _schema(args.json_schema) if args.json_schema else None
    kb = open_kb(args.kb, args.model, args.store, args.precision, remote(args), args.device, decodes="few")
    group = _group(kb, args.group)
    try:
        chunks = [h.chunk for h in index.search(args.question, args.top_k, args.retriever, group)] if index else []
        if ratio == "auto":
            attach_controller(kb.engine, kb.state_dir)
        grammar = _grammar(kb.tok, schema, args.json_schema) if schema is not None else None
        answer = kb.ask(args.question, group, args.tenant, chunks, ratio, args.max_tokens, quote=not args.no_quote,
                        constraint=grammar)
    except (KBError, RequestError, ModeUnavailableError, RetrievalIndexError) as e:
        raise _fail(e) from None
    finally:
        kb.engine.store.flush()
    if args.json:
        print(json.dumps(answer.as_dict()))
        return 0
    print(answer_lines(answer.answer, answer.conflicts, color=sys.stdout.isatty() and "NO_COLOR" not in os.environ))
    for c in answer.citations:
        print(f"  {citation_line(c)}")
    for x in answer.conflicts:
        print(f'  CONFLICT: {x.doc_id} states {x.found}, not {x.stated}: "{x.quote}"')
    if answer.finish_reason == "length":
        print(f"  (the answer reached --max-tokens {args.max_tokens} and may be cut short)", file=sys.stderr)
    print(f"[{answer.mode}] ttft {answer.ttft_s:.3f}s, cached share {answer.cached_token_share:.1%}, "
          f"cost {answer.cost_units['total']:.0f} units", file=sys.stderr)
    return 0


def _schema(path: str) -> str:
    """The JSON Schema in the file as a grammar (`server.grammar`), checked before any model loads, or a
    one-line error."""
    from kvfuse.server.grammar import grammar_for

    try:
        schema = json.loads(read(path, "--json-schema"))
        if not isinstance(schema, dict):
            raise ValueError("it must hold a JSON object (a JSON Schema)")
        grammar = grammar_for({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    except ValueError as e:  # JSONDecodeError too
        raise SystemExit(f"kvfuse: --json-schema {path}: {e}") from None
    assert grammar is not None
    return grammar


def _grammar(tok: Any, grammar: str, path: str) -> Any:
    """The grammar over the model's tokens, or a one-line error."""
    from kvfuse.server.grammar import Grammar

    try:
        return Grammar(tok.hf, grammar)
    except (ValueError, AttributeError) as e:
        raise SystemExit(f"kvfuse: --json-schema {path}: {e}") from None


def citation_line(c: Any) -> str:
    """One citation as a person reads it: what it is, then the text."""
    where = f", {c.doc_id}" if c.doc_id else ""
    verdict = "supports the answer" if c.supports else "does not support the answer"
    label = {"verified": f"quote (verified{where}; {verdict})", "not_found": "quote (NOT FOUND in the sources)",
             "no_usable_quote": "no usable quote from the model",
             "retrieved": f"passage found by search{where}; {verdict}"}.get(c.state, c.state)
    return f'{label}: "{c.quote}"' if c.quote else label


def cmd_compare(args: argparse.Namespace) -> int:
    from kvfuse.eval.compare import compare_chart, compare_table, load_questions, parse_compare_methods, run_compare
    from kvfuse.kb.manifest import KBError

    try:
        methods = parse_compare_methods(args.methods)
        questions = load_questions(args.questions)[: args.cases]
    except KBError as e:
        raise _fail(e) from None
    kb = open_kb(args.kb, args.model, args.store, args.precision, remote(args), args.device)
    group = _group(kb, args.group)
    try:
        res = run_compare(kb, questions, methods, group, max_tokens=args.max_tokens, progress=not args.quiet,
                          quote=not args.no_quote)
    except KBError as e:
        raise _fail(e) from None
    kb.engine.store.flush()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_text(json.dumps(res, indent=1))
        (out / "compare.md").write_text(compare_table(res))
        compare_chart(res, out / "compare.png")
    if args.json:
        print(json.dumps({k: v for k, v in res.items() if k != "per_question"}))
    else:
        print(compare_table(res))
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.kb.manifest import MANIFEST, KBError, load_manifest, resolve_kb_dir
    from kvfuse.rag.index import Index, RetrievalIndexError, SourceDoc
    from kvfuse.text import Tokenizer

    src = bundled(args.src)
    try:
        if (resolve_kb_dir(src) / MANIFEST).is_file():
            m = load_manifest(src)
            docs = [SourceDoc(d.id, d.title, d.text, d.groups) for d in m.documents]
        else:
            root = Path(src)
            files = sorted(p for p in root.glob("*") if p.suffix in (".md", ".txt")) if root.is_dir() else []
            if not files:
                raise KBError(f"{src} is neither a knowledge base nor a directory of .md/.txt files")
            docs = []
            for f in files:
                text = f.read_text(encoding="utf-8").strip()
                title = text.splitlines()[0].strip() if text else f.stem
                docs.append(SourceDoc(f.stem, title, text))
        index = Index.build(docs, Tokenizer(resolve_model_path(args.model)), args.chunk_tokens, args.overlap)
        index.save(args.out)
    except (KBError, RetrievalIndexError, ValueError) as e:
        raise _fail(e) from None
    print(json.dumps({"out": args.out, "documents": len(docs), "chunks": len(index.chunks), **index.settings}))
    return 0
