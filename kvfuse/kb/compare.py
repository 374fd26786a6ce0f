"""`kvfuse compare`: the seed's "fifty questions" workflow, CAG against full prefill and RAG.

Methods: `cag` (answer from the group's cached prefix), `full` (the same prompt, prefilled from
scratch), and `rag-bm25@K`, `rag-dense@K`, `rag-hybrid@K` (the instructions plus the top-K chunks of
an index over the same documents, prefilled: classic RAG, nothing cached). Per method: accuracy
(contains-gold and F1), TTFT median, and cost units per question (CAG's one build write is spread
over the questions). For RAG, each miss is attributed: was the gold document retrieved (a reading
miss) or not (a search miss)?
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfuse.eval.metrics import best_f1, contains_gold
from kvfuse.kb.base import KnowledgeBase
from kvfuse.kb.manifest import KBError
from kvfuse.kb.prefix import header_text
from kvfuse.rag.index import Index, SourceDoc
from kvfuse.request import Request
from kvfuse.sampling import SamplingParams
from kvfuse.text.deltas import complete_text
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
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise KBError(f"cannot read --questions {p}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise KBError(f"--questions {p} is not valid JSON: {e}") from None
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
                default_group: str, index: Index | None = None, max_tokens: int = 32,
                progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    eng, tok = kb.engine, kb.tok
    params = SamplingParams(max_tokens=max_tokens)
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
            rec: dict[str, Any] = {}
            if kind == "cag":
                a = kb.ask(q.question, group, quote=False, max_tokens=max_tokens)
                text, ttft = a.answer, a.ttft_s
                units = a.cost_units["read"] + a.cost_units["uncached"]
                units += builds[group].tokens_recomputed * kb.costs.write / len(questions)
            else:
                plan = kb.plan(group)
                suffix = tuple(tok.encode(question_text(q.question)))
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
                stream = eng.stream(Request(suffix=suffix, prefix=tuple(ids)), "full", None, params)
                text = complete_text(stream, tok).strip()
                assert stream.result is not None
                ttft = stream.result.ttft_s
                units = (len(ids) + len(suffix)) * kb.costs.uncached
            rec.update({"answer": text, "contains_gold": contains_gold(text, q.answers),
                        "f1": best_f1(text, q.answers), "ttft_s": ttft, "cost_units": units})
            row["methods"][name] = rec
            bar.update(1)
        rows.append(row)
    bar.close()
    summary = {}
    for name, kind, _ in methods:
        recs = [r["methods"][name] for r in rows]
        s: dict[str, Any] = {
            "accuracy": statistics.mean(float(r["contains_gold"]) for r in recs),
            "f1": statistics.mean(r["f1"] for r in recs),
            "ttft_s_median": statistics.median(r["ttft_s"] for r in recs),
            "cost_units_mean": statistics.mean(r["cost_units"] for r in recs),
            "n": len(recs),
        }
        if kind.startswith("rag"):
            wrong = [r for r in recs if not r["contains_gold"]]
            s["search_misses"] = sum(1 for r in wrong if r.get("gold_retrieved") is False)
            s["reading_misses"] = sum(1 for r in wrong if r.get("gold_retrieved") is True)
            s["gold_retrieved"] = statistics.mean(float(bool(r.get("gold_retrieved"))) for r in recs)
        summary[name] = s
    return {"kb": kb.name, "questions": len(questions), "builds": {g: b.as_dict() for g, b in builds.items()},
            "methods": summary, "per_question": rows}


def compare_table(res: dict[str, Any]) -> str:
    lines = ["| method | contains gold | F1 | TTFT median (s) | cost units / question | search misses | "
             "reading misses |", "|---|---|---|---|---|---|---|"]
    for name, s in res["methods"].items():
        lines.append(f"| {name} | {s['accuracy']:.3f} | {s['f1']:.3f} | {s['ttft_s_median']:.3f} | "
                     f"{s['cost_units_mean']:.0f} | {s.get('search_misses', '-')} | {s.get('reading_misses', '-')} |")
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

