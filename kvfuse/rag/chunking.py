"""Token-based chunking. Chunks are character spans of their source, so a chunk's text is verbatim and
quotes found in it map back to offsets in the document."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Encoder(Protocol):
    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...


@dataclass(frozen=True, slots=True)
class Span:
    start: int  # character offsets into the source text, end exclusive
    end: int
    tokens: int


def token_windows(text: str, tok: Encoder, size: int, overlap: int = 0) -> list[Span]:
    """Split text into spans of at most `size` tokens, each starting `size - overlap` tokens after the last."""
    if size <= 0:
        raise ValueError(f"chunk size must be a positive number of tokens, got {size}")
    if not 0 <= overlap < size:
        raise ValueError(f"overlap must be at least 0 and smaller than the chunk size {size}, got {overlap}")
    ids, offsets = tok.encode_offsets(text)
    if not ids:
        return []
    spans, step = [], size - overlap
    for s in range(0, len(ids), step):
        e = min(len(ids), s + size)
        spans.append(Span(offsets[s][0], offsets[e - 1][1], e - s))
        if e == len(ids):
            break
    return spans


def pack(texts: Sequence[str], tok: Encoder, size: int, sep: str = "\n\n") -> list[str]:
    """Pack whole texts, in order, into chunks of at most `size` tokens (joined by sep); a text longer
    than `size` is split into token windows of its own. Token counts are of each text on its own, so a
    packed chunk can differ from the limit by the separator's tokens."""
    chunks: list[str] = []
    cur: list[str] = []
    used = 0
    for text in texts:
        n = len(tok.encode_offsets(text)[0])
        if n > size:
            if cur:
                chunks.append(sep.join(cur))
                cur, used = [], 0
            chunks.extend(text[sp.start : sp.end] for sp in token_windows(text, tok, size))
            continue
        if cur and used + n > size:
            chunks.append(sep.join(cur))
            cur, used = [], 0
        cur.append(text)
        used += n
    if cur:
        chunks.append(sep.join(cur))
    return chunks
