"""Cost in units of one uncached input token, the way the CAG seed counts it for Albarán.

A cache write costs `write` (1.25: 25% more than an uncached token), a cache read `read` (0.1) and an
uncached token `uncached` (1.0). The seed's day: 600 questions over a 32,000-token prefix, rewritten
about ten times, costs 10 * 32,000 * 1.25 + 590 * 32,000 * 0.1 = 2.29 million units with a cache,
600 * 32,000 = 19.2 million without, and 600 * 2,000 = 1.2 million with RAG over four 500-token chunks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    write: float = 1.25
    read: float = 0.1
    uncached: float = 1.0

    def __post_init__(self) -> None:
        if min(self.write, self.read, self.uncached) < 0:
            raise ValueError("cost units cannot be negative")

    def request(self, written: int, cached: int, computed: int) -> dict[str, float]:
        """One request: tokens written to the cache, read from it, and computed without it."""
        w, r, u = written * self.write, cached * self.read, computed * self.uncached
        return {"write": round(w, 3), "read": round(r, 3), "uncached": round(u, 3), "total": round(w + r + u, 3)}

    def daily(self, prefix_tokens: int, questions: int, writes: int, rewrite_tokens: int | None = None,
              rag_tokens: int = 2000) -> dict[str, dict[str, float]]:
        """A day's prefix cost: with the cache (`writes` writes, the rest reads), with no cache, and with RAG.

        rewrite_tokens is what one write recomputes (default: the whole prefix, as the seed counts it;
        an edit of the last document rewrites only from it to the end)."""
        if questions < 0 or writes < 0:
            raise ValueError("questions and writes per day cannot be negative")
        per_write = prefix_tokens if rewrite_tokens is None else rewrite_tokens
        writes = min(writes, questions) if questions else writes
        w = writes * per_write * self.write
        # a question that comes right after a write reads what was just written; the others read it all
        reads = (questions - writes) * prefix_tokens * self.read + writes * (prefix_tokens - per_write) * self.read
        return {
            "cag": {"write": round(w, 1), "read": round(reads, 1), "total": round(w + reads, 1)},
            "no_cache": {"total": float(questions * prefix_tokens * self.uncached)},
            "rag": {"total": float(questions * rag_tokens * self.uncached)},
        }

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
