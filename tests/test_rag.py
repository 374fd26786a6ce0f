import json

import pytest
from chartok import CharTokenizer

from kvfuse.rag.index import Index, RetrievalIndexError, SourceDoc, rrf

DOCS = [
    SourceDoc("returns", "Team plan terms", "7. Returns. Annual subscriptions have 30 calendar days from the date "
              "of the charge to be cancelled and returned in full.", ("support", "leads")),
    SourceDoc("faq", "Refunds FAQ", "As a rule, refunds can be requested within 14 days of the charge.",
              ("support", "leads")),
    SourceDoc("margins", "Commercial discount margins", "A lead may approve a discount of at most 22% on Business "
              "annual plans.", ("leads",)),
    SourceDoc("weather", "Office notes", "The office kitchen is cleaned every Friday afternoon.", ()),
]


@pytest.fixture(scope="module")
def index() -> Index:
    return Index.build(DOCS, CharTokenizer(), chunk_tokens=80, overlap=10)


def test_rrf_known_values() -> None:
    # a: ranks 0 and 1 -> 1/61 + 1/62; b: 1 and 0 -> the same; c: only 2 in the first -> 1/63
    assert rrf([[0, 1, 2], [1, 0]], k=60) == [0, 1, 2]
    assert rrf([[5, 6], [6, 7], [6]]) == [6, 5, 7]


def test_chunks_have_headers_and_overlap(index) -> None:
    returns = [c for c in index.chunks if c.doc_id == "returns"]
    assert len(returns) >= 2 and all(c.headed.startswith("Team plan terms\n") for c in returns)
    assert returns[0].end > returns[1].start  # 10 tokens (characters) of overlap
    assert all(DOCS[0].text[c.start : c.end] == c.text for c in returns)


def test_bm25_dense_and_hybrid(index) -> None:
    top = lambda q, m, g=None: index.search(q, 1, m, g)[0].chunk.doc_id  # noqa: E731
    assert top("refunds requested within days", "bm25") == "faq"  # exact words
    assert top("when is the kitchen cleaned", "dense") == "weather"
    assert top("maximum discount a lead may approve", "hybrid", "leads") == "margins"
    for method in ("bm25", "dense", "hybrid"):
        hits = index.search("discount margins approve", 10, method, "support")
        assert "margins" not in {h.chunk.doc_id for h in hits}  # a group only searches what it may read
        assert [h.rank for h in hits] == list(range(len(hits)))
    with pytest.raises(RetrievalIndexError, match="unknown retriever"):
        index.search("x", 1, "nope")


def test_index_persists_and_reports_damage(index, tmp_path) -> None:
    path = index.save(tmp_path / "ix")
    again = Index.load(path)
    assert again.chunks == index.chunks and again.settings == index.settings
    assert [h.chunk for h in again.search("refund days", 3, "hybrid")] == \
           [h.chunk for h in index.search("refund days", 3, "hybrid")]
    index.save(tmp_path / "ix")  # saving over an index replaces it whole
    raw = json.loads((path / "index.json").read_text())
    raw["chunks"] = raw["chunks"][:-1]
    (path / "index.json").write_text(json.dumps(raw))
    with pytest.raises(RetrievalIndexError, match="inconsistent"):
        Index.load(path)
    (path / "dense.npy").write_bytes(b"garbage")
    with pytest.raises(RetrievalIndexError, match="damaged"):
        Index.load(path)
    with pytest.raises(RetrievalIndexError, match="not a kvfuse index"):
        Index.load(tmp_path / "nowhere")
