"""A retrieval index persisted on disk: token chunks with contextual headers, BM25, dense and hybrid search.

Chunks are token windows with overlap over each document; each chunk's indexed and prompt text starts
with its document's title (the seed's contextual chunk header), so a section that never names its plan
still carries "Team plan terms" with it. Search can be limited to the groups a caller may read.

Layout of an index directory (written to a temporary directory and renamed into place):
    index.json   format, settings and the chunks (doc id, title, groups, character span, text)
    dense.npy    (n, 384) float32 all-MiniLM-L6-v2 embeddings of the headed chunk texts
    bm25/        the bm25s index of the same texts
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvfuse.rag.chunking import Encoder, token_windows

INDEX_FORMAT = 1
RRF_K = 60  # reciprocal-rank fusion constant (Cormack et al.)


class RetrievalIndexError(ValueError):
    """The index cannot be used as given; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class SourceDoc:
    id: str
    title: str
    text: str
    groups: tuple[str, ...] = ()  # empty: readable by everyone


@dataclass(frozen=True, slots=True)
class IndexChunk:
    doc_id: str
    title: str
    groups: tuple[str, ...]
    start: int  # character span in the document's text
    end: int
    text: str

    @property
    def headed(self) -> str:
        """The chunk with its contextual header: what is indexed and what goes into the prompt."""
        return f"{self.title}\n{self.text}" if self.title else self.text


@dataclass(frozen=True, slots=True)
class Hit:
    chunk: IndexChunk
    rank: int
    score: float


def _bm25_tokens(texts: Sequence[str]) -> Any:
    import bm25s

    return bm25s.tokenize(list(texts), stopwords="en", return_ids=False, show_progress=False)


Ranker = Callable[["Index", str], list[int]]  # all chunk ids, best first
RETRIEVERS: dict[str, Ranker] = {}


def register(name: str) -> Callable[[Ranker], Ranker]:
    def deco(f: Ranker) -> Ranker:
        RETRIEVERS[name] = f
        return f

    return deco


class Index:
    def __init__(self, chunks: Sequence[IndexChunk], dense: np.ndarray, bm25: Any, settings: dict[str, Any]) -> None:
        self.chunks, self.dense, self.bm25, self.settings = list(chunks), dense, bm25, settings

    # -- building and persistence ------------------------------------------------------------------

    @classmethod
    def build(cls, docs: Sequence[SourceDoc], tok: Encoder, chunk_tokens: int = 256, overlap: int = 32) -> Index:
        import bm25s

        from kvfuse.rag.dense import embed

        chunks = []
        for d in docs:
            for sp in token_windows(d.text, tok, chunk_tokens, overlap):
                chunks.append(IndexChunk(d.id, d.title, tuple(d.groups), sp.start, sp.end, d.text[sp.start : sp.end]))
        if not chunks:
            raise RetrievalIndexError("nothing to index: the documents are empty")
        texts = [c.headed for c in chunks]
        bm25 = bm25s.BM25()
        bm25.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
        dense = embed(texts)
        digest = hashlib.sha256(json.dumps([asdict(d) for d in docs], sort_keys=True).encode()).hexdigest()[:12]
        settings = {"format": INDEX_FORMAT, "chunk_tokens": chunk_tokens, "overlap": overlap, "documents": len(docs),
                    "sources": digest}
        return cls(chunks, dense, bm25, settings)

    def save(self, path: str | Path) -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
        try:
            (tmp / "index.json").write_text(json.dumps(
                {**self.settings, "chunks": [asdict(c) for c in self.chunks]}), encoding="utf-8")
            np.save(tmp / "dense.npy", self.dense)
            self.bm25.save(str(tmp / "bm25"))
            old = target.with_name(f".{target.name}.old")
            if target.exists():
                os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    @classmethod
    def load(cls, path: str | Path) -> Index:
        import bm25s

        p = Path(path)
        try:
            raw = json.loads((p / "index.json").read_text(encoding="utf-8"))
            dense = np.load(p / "dense.npy")
            bm25 = bm25s.BM25.load(str(p / "bm25"))
        except FileNotFoundError as e:
            raise RetrievalIndexError(f"{p} is not a kvfuse index (missing {Path(e.filename).name}); build one with "
                              "`kvfuse index build`") from None
        except (ValueError, OSError, KeyError) as e:
            raise RetrievalIndexError(
                f"the index at {p} is damaged ({e}); rebuild it with `kvfuse index build`") from None
        if raw.get("format") != INDEX_FORMAT:
            raise RetrievalIndexError(
                f"the index at {p} has format {raw.get('format')}, expected {INDEX_FORMAT}; rebuild it")
        chunks = [IndexChunk(c["doc_id"], c["title"], tuple(c["groups"]), c["start"], c["end"], c["text"])
                  for c in raw.pop("chunks")]
        if dense.shape[0] != len(chunks):
            raise RetrievalIndexError(
                f"the index at {p} is inconsistent ({dense.shape[0]} vectors, {len(chunks)} chunks); rebuild it")
        return cls(chunks, dense, bm25, raw)

    # -- search ------------------------------------------------------------------------------------

    def search(self, query: str, k: int, method: str = "hybrid", group: str | None = None) -> list[Hit]:
        """The k best chunks for the query that `group` may read (all chunks when group is None)."""
        if method not in RETRIEVERS:
            raise RetrievalIndexError(f"unknown retriever {method!r}; choose one of {', '.join(sorted(RETRIEVERS))}")
        if k <= 0:
            raise RetrievalIndexError("k must be a positive number of chunks")
        order = RETRIEVERS[method](self, query)
        allowed = [i for i in order if group is None or not self.chunks[i].groups or group in self.chunks[i].groups]
        return [Hit(self.chunks[i], r, 1.0 / (r + 1)) for r, i in enumerate(allowed[:k])]


@register("bm25")
def bm25_order(index: Index, query: str) -> list[int]:
    docs, scores = index.bm25.retrieve(_bm25_tokens([query]), k=len(index.chunks), show_progress=False)
    return [int(i) for i in docs[0]]


@register("dense")
def dense_order(index: Index, query: str) -> list[int]:
    from kvfuse.rag.dense import embed, l2_order

    return l2_order(embed([query])[0], index.dense)


@register("hybrid")
def hybrid_order(index: Index, query: str) -> list[int]:
    """Reciprocal-rank fusion of BM25 and dense: score(d) = sum over rankers of 1 / (RRF_K + rank)."""
    return rrf([bm25_order(index, query), dense_order(index, query)])


def rrf(rankings: Sequence[Sequence[int]], k: int = RRF_K) -> list[int]:
    scores: dict[int, float] = {}
    for ranking in rankings:
        for r, i in enumerate(ranking):
            scores[i] = scores.get(i, 0.0) + 1.0 / (k + r + 1)
    return sorted(scores, key=lambda i: (-scores[i], i))
