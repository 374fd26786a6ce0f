"""`make run`: the Albarán demo. CAG answers a policy question from a persisted knowledge cache; then the
hybrid fuses a retrieved support ticket after the same cached prefix with the default fusion mode."""

from __future__ import annotations

from pathlib import Path

from kvfuse.kb.answer import Answer

QUESTION = "How many days does a Team plan customer have to ask for a refund on an annual renewal?"
TICKET_QUESTION = "Is the customer on ticket 4812 entitled to a refund?"
GROUP = "support"


def _show(a: Answer) -> None:
    from kvfuse.kb.conflicts import answer_lines

    print("  answer: " + answer_lines(repr(a.answer), a.conflicts))
    for c in a.citations:
        verdict = "SUPPORTS the answer" if c.supports else "does NOT support the answer"
        if c.state == "retrieved":
            print(f"  passage found by search (not quoted by the model) [{c.doc_id}], {verdict}: \"{c.quote}\"")
        elif c.state == "verified":
            print(f"  quote check: EXISTS in {c.doc_id} at characters {c.start}-{c.end}, {verdict}: \"{c.quote}\"")
        elif c.state == "no_usable_quote":
            print("  quote check: the model gave no usable quote")
        else:
            print(f"  quote check: NOT FOUND in any source document: \"{c.quote}\"")
    for x in a.conflicts:
        print(f"  CONFLICT: {x.doc_id} states {x.found}, not {x.stated}, at characters {x.start}-{x.end}: "
              f"\"{x.quote}\"")
    t = a.tokens
    print(f"  TTFT {a.ttft_s * 1000:.0f} ms; prompt {t['prompt']} tokens, {t['cached']} from the cache, "
          f"{t['computed']} computed; cached-token share {a.cached_token_share:.1%}")
    cu = a.cost_units
    print(f"  cost units: write {cu['write']:.0f} + read {cu['read']:.0f} + uncached {cu['uncached']:.0f} = "
          f"{cu['total']:.0f} (without a cache: {t['prompt']})")


def run_demo(model: str | None = None, store: str | None = None, precision: str = "fp32", device: str = "cpu") -> int:
    from kvfuse.checkpoints import cache_dir
    from kvfuse.fuse import DEFAULT_MODE
    from kvfuse.rag.index import Index, RetrievalIndexError, SourceDoc
    from kvfuse.runtime import open_engine, open_kb, store_dir

    print("Loading the model (the first run converts Gemma 3 270M once)...", flush=True)
    where = store_dir(store)
    rt = open_engine(model, where, precision=precision, device=device, decodes="few")  # two answers
    engine, tok = rt.engine, rt.tok
    kb = open_kb("albaran", rt, where)
    r = kb.build(GROUP, progress=True)
    if r.loaded:
        print(f"Loaded the persisted Albarán cache ({r.tokens_total} tokens, group {GROUP}) in {r.build_s:.2f} s.")
    else:
        print(f"Built the Albarán cache: {r.tokens_total} tokens ({r.tokens_recomputed} computed, "
              f"{r.tokens_reused} reused) in {r.build_s:.1f} s, {r.bytes / 2**20:.0f} MiB, stored in {where}.")

    print(f"\n1. CAG, from the cached policies\n  question: {QUESTION}\n  (the Team terms say 30 calendar days; "
          "the FAQ's general rule of 14 days is the trap)")
    _show(kb.ask(QUESTION, GROUP))

    index_dir = cache_dir() / "indexes" / "albaran-tickets"
    try:
        index = Index.load(index_dir)
    except RetrievalIndexError:
        from importlib import resources

        root = Path(str(resources.files("kvfuse").joinpath("data/albaran-tickets")))
        docs = [SourceDoc(f.stem, f.read_text(encoding="utf-8").splitlines()[0], f.read_text(encoding="utf-8"))
                for f in sorted(root.glob("ticket-*.md"))]
        index = Index.build(docs, tok, chunk_tokens=256, overlap=32)
        index.save(index_dir)
    hits = index.search(TICKET_QUESTION, 1, "hybrid", GROUP)
    print(f"\n2. Hybrid: the cached policies, plus {hits[0].chunk.doc_id} retrieved and fused (mode {DEFAULT_MODE})\n"
          f"  question: {TICKET_QUESTION}")
    _show(kb.ask(TICKET_QUESTION, GROUP, chunks=[h.chunk for h in hits]))
    engine.store.flush()
    print("\nRun it again: the second run loads the persisted cache instead of rebuilding it.")
    print("Ask it in a browser: run `kvfuse serve --kb albaran`, then open http://127.0.0.1:8000/")
    return 0
