"""THE prompt layout: every piece of prompt text kvfuse writes is spelled here, once.

    <bos> HEAD                          the fixed instruction head (or a knowledge base's header)
    PREFIX_TEXT "\\n\\n"                  a prefix file, if one is given
    CHUNK_1 "\\n\\n" ... CHUNK_n "\\n\\n"    chunks (retrieved passages, request documents), in order
    "=== TITLE [doc:ID] ===\\nTEXT\\n\\n"    a knowledge-base document or a retrieved piece of one
    "Question: " QUESTION "\\nAnswer:"     the suffix

Each segment is tokenised on its own, so a chunk's ids never depend on its neighbours and a chunk's
cache key is the same wherever it is retrieved. Segment text is stripped of surrounding whitespace,
and a question's inner whitespace is collapsed, so the same input always gives the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvfuse.request import Request

HEAD = (
    "Answer the question using the passages below. Some questions need facts from more than one "
    "passage. Answer with a few words only.\n\n"
)


class Encoder(Protocol):
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...


def bos(tok: Encoder) -> list[int]:
    """The ids every prompt starts with: BOS, where the model has one."""
    return [tok.bos_id] if tok.bos_id is not None else []


def chunk_text(text: str) -> str:
    """A chunk (a passage, a document sent with a request, a prefix file) as it appears in a prompt."""
    return text.strip() + "\n\n"


def section_text(title: str, doc_id: str, text: str) -> str:
    """A knowledge-base document (or a retrieved piece of one) as it appears in a prompt."""
    return f"=== {title} [doc:{doc_id}] ===\n{text}\n\n"


def kb_header_text(name: str, instructions: str) -> str:
    """The head of a knowledge base's prefix."""
    return f"Knowledge base: {name}\n\nInstructions:\n{instructions}\n\n"


def question_text(question: str) -> str:
    """The suffix: the question, then where the answer starts."""
    return f"Question: {' '.join(question.split())}\nAnswer:"


def chunk_ids(tok: Encoder, texts: tuple[str, ...] | list[str]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(tok.encode(chunk_text(t))) for t in texts)


@dataclass(frozen=True, slots=True)
class Prompt:
    head: str = HEAD
    prefix_text: str | None = None
    chunks: tuple[str, ...] = ()
    question: str = ""

    def request(self, tok: Encoder, prefix_mode: bool = False) -> Request:
        """Token ids by segment; with prefix_mode, everything before the question is the prefix."""
        head = bos(tok) + tok.encode(self.head)
        if self.prefix_text is not None:
            head += tok.encode(chunk_text(self.prefix_text))
        chunks = chunk_ids(tok, self.chunks)
        suffix = tuple(tok.encode(question_text(self.question)))
        if prefix_mode:
            return Request(prefix=tuple(head) + tuple(t for c in chunks for t in c), suffix=suffix)
        return Request(prefix=tuple(head), chunks=chunks, suffix=suffix)
