"""The deterministic prefix of a knowledge base for one access group.

Layout (each segment tokenised on its own, so editing one document leaves every other segment's ids alone):

    <bos> "Knowledge base: NAME\\n\\nInstructions:\\nINSTRUCTIONS\\n\\n"
    "=== TITLE [doc:ID] ===\\nTEXT\\n\\n"        for each readable document, sorted by (stability, id)

then, per request, any retrieved chunks and "Question: Q\\nAnswer:". Nothing variable (dates, request
ids, unordered maps) is ever placed before the question.

Cache keys. Every block of the prefix carries the knowledge base's name and the group as extra keys,
so groups never share cache entries. With a tenant, the blocks overlapping a document that is not
`shared` also carry the tenant's salt; since block hashes chain, every block after the first private
document is private too, which is one more reason stable, public documents go first.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

from kvfuse.kb.manifest import Document, Manifest
from kvfuse.request import Salt, SaltSpan
from kvfuse.text.layout import bos, kb_header_text, question_text, section_text


class TextEncoder(Protocol):
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Segment:
    name: str  # "instructions" or a document id
    start: int  # token offsets into the prefix ids
    end: int
    shared: bool


@dataclass(frozen=True, slots=True)
class PrefixPlan:
    kb: str
    group: str
    tenant: str | None
    ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    salts: tuple[SaltSpan, ...]
    documents: tuple[Document, ...]

    @property
    def version(self) -> str:
        """A short content hash of this group's prefix (what the group reads, not who asks)."""
        return hashlib.sha256(repr(self.ids).encode()).hexdigest()[:12]

    def segment_at(self, token: int) -> Segment:
        for s in self.segments:
            if s.start <= token < s.end:
                return s
        raise IndexError(token)


def header_text(m: Manifest) -> str:
    return kb_header_text(m.name, m.instructions)


def document_text(d: Document) -> str:
    return section_text(d.title, d.id, d.text)


__all__ = ["PrefixPlan", "Segment", "TextEncoder", "document_text", "header_text", "plan_prefix", "question_text"]


def plan_prefix(m: Manifest, tok: TextEncoder, group: str, tenant: str | None = None) -> PrefixPlan:
    docs = m.readable(group)
    ids: list[int] = bos(tok)
    segments = []
    for name, text, shared in [("instructions", header_text(m), True)] + [
        (d.id, document_text(d), d.shared) for d in docs
    ]:
        start = len(ids)
        ids += tok.encode(text)
        segments.append(Segment(name, 0 if name == "instructions" else start, len(ids), shared))
    salts = [SaltSpan(0, len(ids), Salt(kb=m.name, group=group))]
    if tenant:
        salts += [SaltSpan(s.start, s.end, Salt(tenant=tenant)) for s in segments if not s.shared]
    return PrefixPlan(m.name, group, tenant, tuple(ids), tuple(segments), tuple(salts), tuple(docs))
