"""`kvfuse compare`: the seed's "fifty questions" workflow, CAG against full prefill and RAG.

Methods: `cag` (answer from the group's cached prefix), `full` (the same prompt, prefilled from
scratch), and `rag-bm25@K`, `rag-dense@K`, `rag-hybrid@K` (the instructions plus the top-K chunks of
an index over the same documents, prefilled: classic RAG, nothing cached). Per method: accuracy
(contains-gold and F1), TTFT median, and cost units per question (CAG's one build write is spread
over the questions). For RAG, each miss is attributed: was the gold document retrieved (a reading
miss) or not (a search miss)?
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfuse.engine.sampling import SamplingParams
from kvfuse.eval.data import read_json
from kvfuse.eval.metrics import best_f1, contains_gold
from kvfuse.kb import answer
from kvfuse.kb.answer import ANSWER_TOKENS
from kvfuse.kb.base import KnowledgeBase
from kvfuse.kb.manifest import Document, KBError
from kvfuse.kb.prefix import header_text
from kvfuse.kb.quotes import Citation
from kvfuse.rag.index import Index, SourceDoc
from kvfuse.request import Request
from kvfuse.text.deltas import complete_answer
from kvfuse.text.layout import bos, question_text, section_text


@dataclass(frozen=True, slots=True)
class Question:
    id: str
    question: str
    answers: tuple[str, ...]
    doc_id: str | None
    group: str | None


def load_questions(path: str | Path) -> list[Question]:
    p = Path(path)
    raw = read_json(p, "--questions", KBError)
    if not isinstance(raw, list) or not raw:
        raise KBError(f"--questions {p} must be a non-empty JSON list of {{question, answers}}")
    out = []
    for i, q in enumerate(raw):
        if not isinstance(q, dict) or not isinstance(q.get("question"), str) or not q.get("answers"):
            raise KBError(f"--questions {p}: item {i} needs a question string and a non-empty answers list")
        answers = q["answers"] if isinstance(q["answers"], list) else [q["answers"]]
        out.append(Question(str(q.get("id", i)), q["question"], tuple(map(str, answers)), q.get("doc_id"),
                            q.get("group")))
    return out


def parse_compare_methods(spec: str) -> list[tuple[str, str, int]]:
    """'cag,full,rag-hybrid@4' -> [(name, kind, k)]."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        base, _, arg = item.partition("@")
        if base in ("cag", "full"):
            if arg:
                raise KBError(f"method {base!r} takes no @K")
            out.append((item, base, 0))
        elif base in ("rag-bm25", "rag-dense", "rag-hybrid"):
            try:
                k = int(arg) if arg else 4
            except ValueError:
                raise KBError(f"{item}: K must be a whole number of chunks") from None
            if k <= 0:
                raise KBError(f"{item}: K must be positive")
            out.append((f"{base}@{k}", base, k))
        else:
            raise KBError(f"unknown method {item!r}; use cag, full, rag-bm25@K, rag-dense@K or rag-hybrid@K")
    if not out:
        raise KBError("--methods is empty")
    return out


def kb_index(kb: KnowledgeBase, chunk_tokens: int = 256, overlap: int = 32) -> Index:
    docs = [SourceDoc(d.id, d.title, d.text, d.groups) for d in kb.manifest.documents]
    return Index.build(docs, kb.tok, chunk_tokens, overlap)


def run_compare(kb: KnowledgeBase, questions: Sequence[Question], methods: Sequence[tuple[str, str, int]],
                default_group: str, index: Index | None = None, max_tokens: int = ANSWER_TOKENS,
                progress: bool = True, quote: bool = True) -> dict[str, Any]:
    """Every method answers every question; with `quote`, each answer is cited as `kvfuse ask` cites:
    the model is asked for a verbatim quote from the prompt it answered from (CAG and full: the group's
    documents; RAG: its retrieved chunks), checked in code, with a passage found by search where none is."""
    from tqdm import tqdm

    if any(kind.startswith("rag") for _, kind, _ in methods) and index is None:
        index = kb_index(kb)
    groups = sorted({q.group or default_group for q in questions})
    builds = {g: kb.build(g) for g in groups}  # CAG's one write per group, before any question
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(questions) * len(methods), desc="compare", unit="answer", disable=not progress)
    for q in questions:
        group = q.group or default_group
        row: dict[str, Any] = {"id": q.id, "question": q.question, "answers": list(q.answers), "doc_id": q.doc_id,
                               "group": group, "methods": {}}
        for name, kind, k in methods:
            if kind == "cag":
                a = kb.ask(q.question, group, quote=quote, max_tokens=max_tokens)
                rec: dict[str, Any] = {"answer": a.answer, "ttft_s": a.ttft_s, "finish_reason": a.finish_reason,
                                       "citations": a.citations}
                units = a.cost_units["read"] + a.cost_units["uncached"]
                rec["cost_units"] = units + builds[group].tokens_recomputed * kb.costs.write / len(questions)
            else:
                assert kind == "full" or index is not None
                rec = _uncached(kb, q, group, kind, k, index, max_tokens, quote)
            text = rec["answer"]
            rec.update({"contains_gold": contains_gold(text, q.answers), "f1": best_f1(text, q.answers),
                        "citations": [c.as_dict() for c in rec["citations"]]})
            row["methods"][name] = rec
            bar.update(1)
        rows.append(row)
    bar.close()
    summary = {name: _summary(kind, [r["methods"][name] for r in rows]) for name, kind, _ in methods}
    return {"kb": kb.name, "questions": len(questions), "builds": {g: b.as_dict() for g, b in builds.items()},
            "methods": summary, "per_question": rows}


def _uncached(kb: KnowledgeBase, q: Question, group: str, kind: str, k: int, index: Index | None, max_tokens: int,
              quote: bool) -> dict[str, Any]:
    """full (the group's whole prefix) or rag-* (the header and k retrieved sections), prefilled every time."""
    eng, tok = kb.engine, kb.tok
    plan = kb.plan(group)
    suffix = tuple(tok.encode(question_text(q.question)))
    rec: dict[str, Any] = {}
    sources: list[Document] = list(plan.documents)
    if kind == "full":
        ids: list[int] = list(plan.ids)
    else:
        assert index is not None
        hits = index.search(q.question, k, kind.removeprefix("rag-"), group)
        ids = bos(tok) + tok.encode(header_text(kb.manifest))
        for h in hits:
            ids += tok.encode(section_text(h.chunk.title, h.chunk.doc_id, h.chunk.text))
        retrieved = sorted({h.chunk.doc_id for h in hits})
        rec["retrieved"] = retrieved
        rec["gold_retrieved"] = q.doc_id in retrieved if q.doc_id else None
        sources = [Document(h.chunk.doc_id, h.chunk.title, "", 0, h.chunk.groups, False, h.chunk.text) for h in hits]
    req = Request(suffix=suffix, prefix=tuple(ids))
    stream = eng.stream(req, "full", None, SamplingParams(max_tokens=max_tokens))
    done = complete_answer(stream, tok)
    assert stream.result is not None
    citations: list[Citation] = []
    if quote and done.text:
        if kind == "full":  # the same prompt as CAG's: quote on its cached prefix
            citations = answer.cite(kb, answer.prepare(kb, q.question, group), done.text)
        else:  # quote from the retrieved chunks it answered from (prefix mode: the same answer as full)
            attempt = answer.ask_quote(eng, tok, answer.quote_request(tok, req, q.question, done.text), "prefix")
            citations = answer.with_support([answer.quote_citation(attempt, sources)], sources,
                                            f"{q.question} {done.text}")
    rec.update({"answer": done.text, "ttft_s": stream.result.ttft_s, "citations": citations,
                "finish_reason": "stop" if done.stopped else stream.result.finish_reason,
                "cost_units": (len(ids) + len(suffix)) * kb.costs.uncached})
    return rec


def _summary(kind: str, recs: list[dict[str, Any]]) -> dict[str, Any]:
    states = [c["state"] for r in recs for c in r["citations"]]
    s: dict[str, Any] = {
        "accuracy": statistics.mean(float(r["contains_gold"]) for r in recs),
        "f1": statistics.mean(r["f1"] for r in recs),
        "ttft_s_median": statistics.median(r["ttft_s"] for r in recs),
        "cost_units_mean": statistics.mean(r["cost_units"] for r in recs),
        "n": len(recs),
        "empty_answers": sum(1 for r in recs if not r["answer"]),
        "truncated": sum(1 for r in recs if r["finish_reason"] == "length"),
        "citations": {st: states.count(st) for st in ("verified", "not_found", "no_usable_quote", "retrieved")},
    }
    if kind.startswith("rag"):
        wrong = [r for r in recs if not r["contains_gold"]]
        s["search_misses"] = sum(1 for r in wrong if r.get("gold_retrieved") is False)
        s["reading_misses"] = sum(1 for r in wrong if r.get("gold_retrieved") is True)
        s["gold_retrieved"] = statistics.mean(float(bool(r.get("gold_retrieved"))) for r in recs)
    return s


def compare_table(res: dict[str, Any]) -> str:
    lines = ["| method | contains gold | F1 | TTFT median (s) | cost units / question | search misses | "
             "reading misses | empty answers | cut at max tokens | quotes verified / not found / unusable | "
             "passages found by search |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in res["methods"].items():
        c = s.get("citations", {})
        lines.append(f"| {name} | {s['accuracy']:.3f} | {s['f1']:.3f} | {s['ttft_s_median']:.3f} | "
                     f"{s['cost_units_mean']:.0f} | {s.get('search_misses', '-')} | {s.get('reading_misses', '-')} | "
                     f"{s.get('empty_answers', '-')} | {s.get('truncated', '-')} | {c.get('verified', 0)} / "
                     f"{c.get('not_found', 0)} / {c.get('no_usable_quote', 0)} | {c.get('retrieved', 0)} |")
    return "\n".join(lines) + "\n"


def compare_chart(res: dict[str, Any], path: Path) -> Path:
    from kvfuse.eval.report import pyplot

    plt = pyplot()
    names = list(res["methods"])
    m = res["methods"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [m[n]["accuracy"] for n in names], label="contains gold")
    axes[0].set_ylabel("accuracy (contains gold)")
    axes[1].bar(names, [m[n]["ttft_s_median"] for n in names], color="tab:orange")
    axes[1].set_ylabel("TTFT median (s)")
    axes[1].set_yscale("log")
    axes[2].bar(names, [m[n]["cost_units_mean"] for n in names], color="tab:green")
    axes[2].set_ylabel("cost units per question")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{res['kb']}: {res['questions']} questions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

