"""Quote verification: a quote counts only if it occurs in a source document, checked in code.

Whitespace runs and case are normalised on both sides; offsets are reported in the original text.
A quote that is not found is returned with verified=False, never silently dropped or repaired. When
the model gives no usable quote, a caller may attach a passage found by retrieval instead, with
source="retrieval": it supports the answer but is not a quote by the model.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvfuse.kb.manifest import Document

MIN_QUOTE_WORDS = 3
_STRIP = " \t\n\"'“”‘’«»`"


@dataclass(frozen=True, slots=True)
class Citation:
    doc_id: str | None
    quote: str
    verified: bool
    start: int | None  # character offsets into the document's text, end exclusive
    end: int | None
    source: str = "model"  # "model": quoted by the model; "retrieval": a supporting passage found by search

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _normalize_with_map(text: str) -> tuple[str, list[int]]:
    """Lower-cased text with whitespace runs collapsed to one space, and each output char's source index."""
    out: list[str] = []
    where: list[int] = []
    in_space = False
    for i, ch in enumerate(text):
        if ch.isspace():
            if not in_space and out:
                out.append(" ")
                where.append(i)
            in_space = True
            continue
        in_space = False
        for low in ch.lower():  # some characters lower-case to two ("İ"): each maps back to i
            out.append(low)
            where.append(i)
    return "".join(out), where


def clean_quote(quote: str) -> str:
    q = quote.strip(_STRIP)
    q = re.sub(r"(\.\.\.|…)$", "", q).strip(_STRIP)
    return q


def usable(quote: str) -> bool:
    return len(clean_quote(quote).split()) >= MIN_QUOTE_WORDS


def find_quote(quote: str, docs: Sequence[Document]) -> Citation:
    """Where the quote occurs verbatim (up to whitespace and case) in docs, or an unverified citation."""
    q = clean_quote(quote)
    nq, _ = _normalize_with_map(q)
    candidates = [nq]
    if nq.endswith("."):
        candidates.append(nq[:-1])  # a sentence quoted with a period the source has elsewhere
    if nq:
        for d in docs:
            nd, where = _normalize_with_map(d.text)
            for c in candidates:
                at = nd.find(c) if c else -1
                if at >= 0:
                    start, end = where[at], where[at + len(c) - 1] + 1
                    return Citation(d.id, d.text[start:end], True, start, end)
    return Citation(None, q, False, None, None)


def sentence_around(doc: Document, start: int, end: int) -> Citation:
    """The sentence(s) of doc covering [start, end), as a retrieval-sourced supporting passage."""
    text = doc.text
    dot = text.rfind(". ", 0, start)
    s = max(dot + 2 if dot >= 0 else 0, text.rfind("\n", 0, start) + 1)
    candidates = [i for i in (text.find(". ", end), text.find("\n", end)) if i >= 0]
    e = min(candidates) + 1 if candidates else len(text)
    while s < e and text[s].isspace():
        s += 1
    while e > s and text[e - 1].isspace():
        e -= 1
    return Citation(doc.id, text[s:e], True, s, e, source="retrieval")
