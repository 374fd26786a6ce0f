"""Conflicts: when an answer states a quantity, passages of the knowledge base relevant to the question
that state a different number in the same unit.

The knowledge base's readable documents are searched with the hybrid retriever (BM25 and dense, fused
by reciprocal rank), each passage headed by its document's title as the seed recommends. In the
`PASSAGES` best passages for the question, every sentence that states a quantity of the answer's unit
family is ranked by the dense similarity of "title. sentence" to the question. A sentence that states
another value, and none with the answer's own, conflicts when it is closer to the question than every
sentence that states the answer's value: the knowledge base's most relevant statement of that quantity
disagrees with the answer. The best `PER_QUANTITY` are returned for each quantity of the answer. So
"14 days" on the Team refund question is flagged by Team terms' "30 calendar days", which is closer to
the question than the FAQ's general "14 days"; "60 days" for how long a closed Team workspace stays
readable is not flagged by the nearby "30 days", because its own "read-only for 60 days" is closer.

A sentence about another case than the question's is left out (`Qualifiers`): where the question names
a billing period (monthly, annual) or a plan (the "X plan" of the documents' titles), a sentence whose
paragraph and document title name only other periods or plans says nothing about the question. So a
question about a monthly Team plan is not flagged by "Annual subscriptions have 30 calendar days", nor
a Business question by the Team terms (issue Q.3; docs/benchmarks.md).

It is a flag for the reader, not a verdict: the passage may be about something else that is counted in
the same unit (measured on the 62 Albarán questions in docs/benchmarks.md, issues J and Q).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvfuse.kb.facts import Quantity, quantities

if TYPE_CHECKING:
    from kvfuse.kb.manifest import Document
    from kvfuse.kb.state import KBState
    from kvfuse.rag.index import Index

PASSAGES = 3  # the passages searched for a conflicting number
PER_QUANTITY = 1  # conflicts reported for each quantity the answer states
INDEX_CHUNKS = (128, 16)  # the index's passages: tokens each, tokens of overlap
INDEXES_KEPT = 16  # indexes kept in memory (one per group and knowledge-base version), oldest dropped first,
# and on disk, least recently used dropped first (`_prune_kept`)
_INDEXES: dict[str, Index] = {}  # by the documents' digest: built once per knowledge-base version
_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class Conflict:
    doc_id: str
    quote: str  # the sentence that states the other number
    start: int  # character offsets into the document's text, end exclusive
    end: int
    stated: str  # the answer's quantity it contradicts ("14 days")
    found: str  # the passage's ("30 days")
    found_text: str = ""  # the passage's own words for it ("30 calendar days"): what "the kb says"

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


# billing periods, each spelled as policies spell it ("per calendar month" counts, it is no period)
PERIODS = {"monthly": r"\bmonth(?:ly|-to-month)\b", "annual": r"\b(?:annual(?:ly)?|yearly|per year)\b"}


@dataclass(frozen=True, slots=True)
class Qualifiers:
    """The classes of mutually exclusive cases a statement can be about: the billing period, and the
    plans the knowledge base's titles name ("Team plan terms" -> Team)."""

    classes: tuple[re.Pattern[str], ...]  # a class's cases are its pattern's named groups

    @classmethod
    def of(cls, docs: Sequence[Document]) -> Qualifiers:
        plans = sorted({m.group(1) for d in docs for m in re.finditer(r"\b([A-Z][a-z]+) plan\b", d.title)})
        # a plan by its capitalised name ("business days" is no plan), or lower-case before "plan"
        plan = "|".join(rf"(?P<{n.lower()}>\b{n}\b|\b{n.lower()} plan\b)" for n in plans) or r"(?!)"
        periods = "|".join(f"(?P<{k}>{v})" for k, v in PERIODS.items())
        return cls((re.compile(periods, re.I), re.compile(plan)))

    def named(self, text: str) -> list[set[str]]:
        """Per class, the cases text names."""
        return [{str(m.lastgroup) for m in rx.finditer(text)} for rx in self.classes]

    def elsewhere(self, question: list[set[str]], statement: str) -> bool:
        """The statement names cases of a class that the question names, and none of the question's."""
        return any(q and here and not q & here for q, here in zip(question, self.named(statement), strict=True))


def _sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence or line of text."""
    out = []
    for m in re.finditer(r"[^\n.!?]+(?:[.!?](?=\s|$)|$)?", text):
        s, e = m.start(), m.end()
        while s < e and text[s].isspace():
            s += 1
        if e - s > 3:
            out.append((s, e))
    return out


def kb_index(docs: Sequence[Document], tok: object) -> Index:
    """A hybrid index over the documents, built once for each set of texts and kept in memory, and on
    disk where the tokenizer names its vocabulary (`Tokenizer.fingerprint`; the passages are cut in
    its tokens): `kvfuse ask` is a process of its own, and embedding a knowledge base's passages took
    3.6 s of its 16-19 (Albarán, stop 56)."""
    digest = hashlib.sha256("\0".join(f"{d.id}\0{d.title}\0{d.text}" for d in docs).encode()).hexdigest()
    with _LOCK:
        if digest not in _INDEXES:
            _INDEXES[digest] = _kept_index(docs, tok, digest)
            while len(_INDEXES) > INDEXES_KEPT:  # edits make new versions: the oldest go
                _INDEXES.pop(next(iter(_INDEXES)))
        return _INDEXES[digest]


def _kept_index(docs: Sequence[Document], tok: object, digest: str) -> Index:
    from kvfuse.checkpoints import cache_dir
    from kvfuse.rag.dense import embedder
    from kvfuse.rag.index import INDEX_FORMAT, Index, RetrievalIndexError, SourceDoc

    vocab = getattr(tok, "fingerprint", None)
    made = f"{digest}\0{vocab}\0{embedder()}\0{INDEX_FORMAT}\0{INDEX_CHUNKS}"
    key = hashlib.sha256(made.encode()).hexdigest()[:24]
    where = cache_dir() / "indexes" / f"conflicts-{key}" if isinstance(vocab, str) else None
    if where is not None and where.is_dir():
        try:
            index = Index.load(where)
        except RetrievalIndexError:
            pass  # damaged (or pruned by another process meanwhile): built again below, and saved over it
        else:
            with contextlib.suppress(OSError):  # a read-only cache: read, not marked
                os.utime(where)  # used now: the last to be pruned
            return index
    index = Index.build([SourceDoc(d.id, d.title, d.text, ()) for d in docs], tok,  # type: ignore[arg-type]
                        *INDEX_CHUNKS)
    if where is not None:
        try:
            index.save(where)
        except OSError:
            return index  # a read-only cache: built again by the next process
        _prune_kept(where.parent)
    return index


def _prune_kept(folder: Path) -> None:
    """Keep the INDEXES_KEPT conflict indexes on disk used last (their folders' times) and delete the
    rest: every edit of a knowledge base's texts makes a new one, and each holds its passages' embeddings.
    A process still reading a deleted one finds it damaged and builds it again."""
    kept = []
    for d in folder.glob("conflicts-*"):
        with contextlib.suppress(OSError):  # gone meanwhile: another process pruned it
            kept.append((d.stat().st_mtime_ns, d))
    for _, d in sorted(kept, reverse=True)[INDEXES_KEPT:]:
        shutil.rmtree(d, ignore_errors=True)


# (the answer's quantity, doc, sentence span, the sentence's quantity of that unit, it agrees)
Candidate = tuple[Quantity, "Document", int, int, Quantity, bool]


def find_conflicts(docs: Sequence[Document], tok: object, question: str, answer: str) -> list[Conflict]:
    """Sentences of the documents relevant to the question that state another value of a quantity the
    answer states (see the module docstring); [] when the answer states none.

    The documents' own work comes first (which sentences state a quantity of the answer's units, for the
    question's case), then retrieval: the passages the question finds, and the sentences' similarity."""
    from kvfuse.rag.dense import embed

    stated = quantities(answer)
    if not stated or not docs:
        return []
    stating = _stating(docs, stated, question)
    if not any(not agree for cands in stating.values() for *_, agree in cands):
        return []
    found: list[Candidate] = []  # in the order the passages rank, each sentence once
    seen: set[tuple[str, int, int]] = set()
    for hit in kb_index(docs, tok).search(question, PASSAGES, "hybrid"):
        fresh = set()
        for c in stating.get(hit.chunk.doc_id, []):  # whole sentences that overlap the passage
            _, d, s, e, _, _ = c
            if e <= hit.chunk.start or s >= hit.chunk.end or (d.id, s, e) in seen:
                continue
            found.append(c)
            fresh.add((d.id, s, e))
        seen |= fresh
    if not any(not agree for *_, agree in found):
        return []
    vecs = embed([question] + [f"{d.title}. {d.text[s:e]}" for _, d, s, e, _, _ in found])
    sims = vecs[1:] @ vecs[0] / ((vecs[1:] ** 2).sum(1) ** 0.5 * float((vecs[0] ** 2).sum() ** 0.5) + 1e-9)
    out: list[Conflict] = []
    for q in stated:
        mine = sorted((i for i, c in enumerate(found) if c[0] is q), key=lambda i: -float(sims[i]))
        best_agreeing = max((float(sims[i]) for i in mine if found[i][5]), default=-1.0)
        for i in [i for i in mine if not found[i][5] and float(sims[i]) > best_agreeing][:PER_QUANTITY]:
            _, d, s, e, f, _ = found[i]
            out.append(Conflict(d.id, d.text[s:e], s, e, str(q), str(f), d.text[s:e][f.start : f.end]))
    return out


def _stating(docs: Sequence[Document], stated: Sequence[Quantity], question: str) -> dict[str, list[Candidate]]:
    """Per document, its sentences that state a quantity in the unit of one the answer states, leaving
    out those about another case than the question's (`Qualifiers`)."""
    qualifiers = Qualifiers.of(docs)
    asked = qualifiers.named(question)
    out: dict[str, list[Candidate]] = {}
    for doc in docs:
        for s, e in _sentences(doc.text):
            paragraph = doc.text[doc.text.rfind("\n", 0, s) + 1 : (doc.text.find("\n", e) + 1 or len(doc.text) + 1) - 1]
            if qualifiers.elsewhere(asked, f"{doc.title}. {paragraph}"):
                continue  # about another period or plan than the question's (a paragraph keeps its case)
            stated_here = quantities(doc.text[s:e])
            for q in stated:
                same_unit = [f for f in stated_here if f.unit == q.unit]
                if same_unit:
                    agree = any(f.value == q.value for f in same_unit)
                    other = next((f for f in same_unit if f.value != q.value), same_unit[0])
                    out.setdefault(doc.id, []).append((q, doc, s, e, other, agree))
    return out


def answer_lines(text: str, conflicts: Sequence[Conflict], color: bool = False) -> str:
    """The answer as a person should read it in a terminal (`kvfuse ask`, the demo): marked as disputed,
    with the knowledge base's value beside it, when a passage states another value (bold yellow with
    `color`)."""
    if not conflicts:
        return text
    says = "; ".join(f"{x.found_text or x.found} ({x.doc_id}), not {x.stated}" for x in conflicts)
    head = f"DISPUTED: {text}"
    return (f"\033[1;33m{head}\033[0m" if color else head) + f"\n  the knowledge base says {says}"


def warm(kb: KBState) -> None:
    """Build every group's index (and load the embedding model) ahead of the first answer that needs it."""
    for group in kb.manifest.groups:
        kb_index(kb.manifest.readable(group), kb.tok)


def conflicts_for(kb: KBState, group: str, question: str, answer: str) -> list[Conflict]:
    """find_conflicts over the documents the group may read."""
    docs = kb.manifest.readable(group)
    return find_conflicts(docs, kb.tok, question, answer)
