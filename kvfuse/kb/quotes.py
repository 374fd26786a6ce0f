"""Quote verification: a quote counts only if it occurs in a source document, checked in code.

Whitespace runs and case are normalised on both sides; offsets are reported in the original text.
Every citation has a `state`:

    verified         the model's quote occurs in a source (verified=True, with offsets)
    not_found        the model's quote occurs in no source; returned as it is, never repaired
    no_usable_quote  the model gave no quote worth checking: too short, no closing quotation mark
                     within a sentence's length, or a loop that repeats itself
    retrieved        a sentence found by search (source="retrieval"), not a quote by the model: it is
                     where the facts may be, not evidence that the answer is right (verified=False)

and, apart from its state, `supports`: the passage carries the answer's content (`kb.facts.supports`,
checked against the document's title and the sentence the quote sits in). A verified quote that does not
support the answer exists, and says nothing for it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvfuse.kb.manifest import Document

MIN_QUOTE_WORDS = 3
LOOP_WORDS = 4  # a run of this many words seen twice in one quote is a loop
_STRIP = " \t\n\"'“”‘’«»`"


@dataclass(frozen=True, slots=True)
class Citation:
    doc_id: str | None
    quote: str
    verified: bool
    start: int | None  # character offsets into the document's text, end exclusive
    end: int | None
    source: str = "model"  # "model": quoted by the model; "retrieval": a supporting passage found by search
    state: str = "not_found"  # verified, not_found, no_usable_quote or retrieved (see the module docstring)
    supports: bool = False  # the passage carries the answer's content (see the module docstring)

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
                    return Citation(d.id, d.text[start:end], True, start, end, state="verified")
    return Citation(None, q, False, None, None, state="not_found")


def looping(quote: str) -> bool:
    """The quote repeats a run of LOOP_WORDS words: the model is looping, not quoting."""
    words = clean_quote(quote).lower().split()
    seen: set[tuple[str, ...]] = set()
    for i in range(len(words) - LOOP_WORDS + 1):
        run = tuple(words[i : i + LOOP_WORDS])
        if run in seen:
            return True
        seen.add(run)
    return False


def no_usable_quote(raw: str) -> Citation:
    """What the model gave instead of a quote, flagged as unusable (kept short, for the record)."""
    text = clean_quote(raw)
    return Citation(None, text[:200], False, None, None, state="no_usable_quote")


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
    return Citation(doc.id, text[s:e], False, s, e, source="retrieval", state="retrieved")


def support_context(doc: Document, start: int, end: int) -> str:
    """What a citation is checked against: its document's title and the sentence(s) the span sits in."""
    return f"{doc.title}. {sentence_around(doc, start, end).quote}"


def judge(citation: Citation, answer: str, docs: Sequence[Document]) -> Citation:
    """The citation with `supports` set: whether the passage it points at carries the answer's content."""
    from dataclasses import replace

    from kvfuse.kb.facts import supports

    doc = next((d for d in docs if d.id == citation.doc_id), None)
    if doc is None or citation.start is None or citation.end is None:
        return replace(citation, supports=False)
    return replace(citation, supports=supports(answer, support_context(doc, citation.start, citation.end)))
