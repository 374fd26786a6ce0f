"""A knowledge base served by CAG: one cached prefix per access group (and tenant), answered from.

build   computes the group's prefix blocks that are not cached yet (an edit recomputes from the first
        changed block to the end), stores them pinned, and records what it built next to the store;
        when every block is already stored (a restart, say) it only loads them into memory.
ask     answers from the cached prefix: the prefix blocks are read, only the question (and the
        prefix's last partial block) is computed, and the answer's own KV lives in the request's
        buffer, so the stored prefix is never extended: the cache is back at the end of the prefix
        for the next question, and nothing is recomputed between questions. With retrieved chunks
        (the hybrid), the chunks are fused after the prefix with blend.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvfuse.engine import Engine, Request
from kvfuse.kb.cost import CostModel
from kvfuse.kb.manifest import (
    Document,
    KBError,
    Manifest,
    delete_document,
    load_manifest,
    put_document,
    with_document,
)
from kvfuse.kb.prefix import PrefixPlan, plan_prefix, question_text
from kvfuse.kb.quotes import Citation, find_quote, sentence_around, usable
from kvfuse.kv import one_thread
from kvfuse.rag.index import IndexChunk
from kvfuse.sampling import SamplingParams
from kvfuse.text import Tokenizer, complete_text

BUILD_STEP = 1024  # tokens per build step (one progress-bar tick)
QUOTE_TOKENS = 64


@dataclass(slots=True)
class BuildReport:
    kb: str
    group: str
    tenant: str | None
    kb_version: str
    tokens_total: int
    tokens_reused: int
    tokens_recomputed: int
    build_s: float
    bytes: int
    loaded: bool  # everything was already stored: the blocks were only loaded

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Answer:
    answer: str
    ttft_s: float
    tokens: dict[str, int]  # prompt, cached, computed
    cached_token_share: float
    cost_units: dict[str, float]
    citations: list[Citation]
    group: str
    kb_version: str
    mode: str
    cumulative_cached_token_share: float
    retrieved: list[str] = field(default_factory=list)  # doc ids of fused chunks (hybrid)
    controller: dict[str, Any] | None = None
    recomputed_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["citations"] = [c.as_dict() for c in self.citations]
        return out


@dataclass(slots=True)
class Prepared:
    """A question turned into an engine request against a group's cached prefix."""

    plan: PrefixPlan
    request: Request
    mode: str
    ratio: float | str | None
    written: int  # tokens written to the cache to prepare it (prefix built now, new chunk caches)
    chunks: tuple[IndexChunk, ...]


class KnowledgeBase:
    def __init__(self, engine: Engine, tok: Tokenizer, manifest: Manifest, state_dir: Path | None = None,
                 costs: CostModel | None = None) -> None:
        self.engine, self.tok, self.manifest = engine, tok, manifest
        self.state_dir = state_dir
        self.costs = costs or CostModel()
        self._plans: dict[tuple[str, str | None], tuple[Manifest, PrefixPlan]] = {}
        self._usage_mem: dict[str, Any] = {}  # usage when there is no state dir
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | Path, engine: Engine, tok: Tokenizer, state_dir: Path | None = None,
             costs: CostModel | None = None) -> KnowledgeBase:
        return cls(engine, tok, load_manifest(path), state_dir, costs)

    @property
    def name(self) -> str:
        return self.manifest.name

    def plan(self, group: str, tenant: str | None = None) -> PrefixPlan:
        """The group's prefix for the current manifest (safe to call while another thread edits)."""
        key = (group, tenant or None)
        with self._lock:
            manifest = self.manifest
            cached = self._plans.get(key)
            if cached is not None and cached[0] is manifest:
                return cached[1]
        plan = plan_prefix(manifest, self.tok, group, tenant or None)
        with self._lock:
            if self.manifest is manifest:
                self._plans[key] = (manifest, plan)
        return plan

    def _check_length(self, plan: PrefixPlan, extra: int = 0) -> None:
        limit = self.engine.cfg.max_position_embeddings
        if len(plan.ids) + extra > limit:
            raise KBError(f"the {plan.group!r} prefix of {self.name!r} has {len(plan.ids)} tokens and the request "
                          f"{extra} more, but the model's window is {limit}; split the knowledge base or move "
                          "documents behind retrieval")

    # -- building ----------------------------------------------------------------------------------

    def cached_tokens(self, plan: PrefixPlan) -> int:
        n = 0
        for h in self.engine.block_hashes(plan.ids, plan.salts):
            if h not in self.engine.store:
                break
            n += self.engine.block_size
        return n

    def ensure_built(self, group: str, tenant: str | None = None) -> BuildReport | None:
        """Build the group's prefix if some full block of it is not stored; None when nothing was missing."""
        plan = self.plan(group, tenant)
        bs = self.engine.block_size
        return self.build(group, tenant) if self.cached_tokens(plan) < len(plan.ids) // bs * bs else None

    def build(self, group: str, tenant: str | None = None, progress: bool = False) -> BuildReport:
        """Compute and store (pinned) what is not cached of the group's prefix; load it when all is."""
        from tqdm import tqdm

        plan = self.plan(group, tenant)
        self._check_length(plan)
        eng, bs = self.engine, self.engine.block_size
        hashes = eng.block_hashes(plan.ids, plan.salts)
        n_full = len(hashes) * bs
        t0 = time.perf_counter()
        reused = self.cached_tokens(plan)
        loaded = reused == n_full
        if loaded:  # stored already: read every block once, so the first question finds them in memory
            with one_thread():
                for h in hashes:
                    eng.store.pin(h)
                    eng.store.get(h)
            computed = 0
        else:
            computed = 0
            steps = list(range(reused + BUILD_STEP - reused % BUILD_STEP, n_full, BUILD_STEP)) + [n_full]
            with tqdm(total=n_full - reused, desc=f"building {self.name}/{group}", unit="tok",
                      disable=not progress) as bar:
                for end in steps:
                    c = eng.precompute_prefix(plan.ids[:end], plan.salts, pin=True)
                    computed += c
                    bar.update(c)
            eng.store.flush()
        build_s = time.perf_counter() - t0
        cfg = eng.cfg
        per_token = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * eng.kv_dtype.itemsize
        report = BuildReport(self.name, group, tenant, plan.version, len(plan.ids), reused, computed,
                             round(build_s, 4), n_full * per_token, loaded)
        self._record_build(plan, hashes, report)
        return report

    def _state_path(self, plan: PrefixPlan) -> Path | None:
        if self.state_dir is None:
            return None
        who = f"{plan.group}@{plan.tenant}" if plan.tenant else plan.group
        return self.state_dir / "kb" / self.name / f"{who}.json"

    def _record_build(self, plan: PrefixPlan, hashes: Sequence[str], report: BuildReport) -> None:
        """Remember this version's blocks; unpin the previous version's blocks that it no longer uses."""
        path = self._state_path(plan)
        if path is None:
            return
        with _locked(path):
            old = _read_json(path)
            keep = set(hashes)
            for h in old.get("blocks", []):
                if h not in keep:
                    self.engine.store.unpin(h)
            state = {"kb_version": plan.version, "blocks": list(hashes), "last_build": report.as_dict(),
                     "built_at": time.time()}
            _write_json(path, state)

    # -- asking ------------------------------------------------------------------------------------

    def prepare(self, question: str, group: str, tenant: str | None = None, chunks: Sequence[IndexChunk] = (),
                ratio: float | str | None = None, suffix_text: str | None = None) -> Prepared:
        if not question.strip():
            raise KBError("the question is empty")
        plan = self.plan(group, tenant)
        for c in chunks:
            if c.groups and group not in c.groups:
                raise KBError(f"chunk of {c.doc_id!r} is not readable by group {group!r}")
        suffix = tuple(self.tok.encode(suffix_text if suffix_text is not None else question_text(question)))
        chunk_ids = tuple(tuple(self.tok.encode(c.headed.strip() + "\n\n")) for c in chunks)
        self._check_length(plan, len(suffix) + sum(len(c) for c in chunk_ids))
        report = self.ensure_built(group, tenant)
        written = report.tokens_recomputed if report is not None else 0
        req = Request(suffix=suffix, prefix=plan.ids, chunks=chunk_ids, salts=plan.salts, chunk_salt=tenant or "")
        mode = "blend" if chunk_ids else "prefix"
        if chunk_ids:
            written += sum(len(c) for c in chunk_ids if self.engine.chunk_key(c, req.chunk_salt)
                           not in self.engine.store)
            self.engine.precompute(req, mode)
        return Prepared(plan, req, mode, ratio if chunk_ids else None, written, tuple(chunks))

    def ask(self, question: str, group: str, tenant: str | None = None, chunks: Sequence[IndexChunk] = (),
            ratio: float | str | None = None, max_tokens: int = 32, quote: bool = True) -> Answer:
        prep = self.prepare(question, group, tenant, chunks, ratio)
        stream = self.engine.stream(prep.request, prep.mode, prep.ratio, SamplingParams(max_tokens=max_tokens))
        text = complete_text(stream, self.tok).strip()
        result = stream.result
        assert result is not None
        citations = self.cite(question, text, prep) if quote else []
        return self.finish(prep, text, result, citations)

    def finish(self, prep: Prepared, text: str, result: Any, citations: list[Citation]) -> Answer:
        """Token accounting, cost and the cumulative cached share of a finished answer."""
        c = result.counts
        cached = c.cached
        computed = c.prompt - c.cached
        share = cached / c.prompt if c.prompt else 0.0
        cumulative = self._add_usage(prep.plan, c.prompt, cached)
        return Answer(
            text, result.ttft_s, {"prompt": c.prompt, "cached": cached, "computed": computed}, round(share, 4),
            self.costs.request(prep.written, cached, computed), citations, prep.plan.group, prep.plan.version,
            prep.mode, round(cumulative, 4), [ch.doc_id for ch in prep.chunks],
            result.controller.as_dict() if result.controller is not None else None, c.recomputed,
        )

    def cite(self, question: str, answer: str, prep: Prepared) -> list[Citation]:
        """Ask the model for a verbatim quote, verify it; fall back to a retrieved supporting sentence."""
        quote = ""
        if answer:
            suffix = question_text(question) + f" {answer}\nQuote: \""
            q = self.prepare(question, prep.plan.group, prep.plan.tenant, prep.chunks, prep.ratio, suffix_text=suffix)
            stream = self.engine.stream(q.request, q.mode, q.ratio, SamplingParams(max_tokens=QUOTE_TOKENS))
            quote = complete_text(stream, self.tok, ('"', "\n")).strip()
        sources = list(prep.plan.documents) + [
            Document(c.doc_id, c.title, "", 0, c.groups, False, c.text) for c in prep.chunks]
        if usable(quote):
            found = find_quote(quote, sources)
            if found.verified:
                return [found]
            support = self.supporting_passage(f"{question} {answer}", sources)
            return [found] + ([support] if support is not None else [])  # flagged, with what search found
        support = self.supporting_passage(f"{question} {answer}", sources)
        return [support] if support is not None else []

    def supporting_passage(self, query: str, docs: Sequence[Document]) -> Citation | None:
        """The sentence of docs that BM25 ranks first for the query, labelled as retrieved."""
        import bm25s

        sentences: list[tuple[Document, int, int]] = []
        for d in docs:
            at = 0
            for part in d.text.replace("\n", ". ").split(". "):
                start = d.text.find(part, at)
                if start >= 0 and len(part.split()) >= 4:
                    sentences.append((d, start, start + len(part)))
                    at = start + len(part)
        if not sentences:
            return None
        retriever = bm25s.BM25()
        retriever.index(bm25s.tokenize([d.text[s:e] for d, s, e in sentences], stopwords="en", show_progress=False),
                        show_progress=False)
        q = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        ids, scores = retriever.retrieve(q, k=1, show_progress=False)
        if float(scores[0][0]) <= 0:
            return None
        d, s, e = sentences[int(ids[0][0])]
        return sentence_around(d, s, e)

    # -- usage and edits ---------------------------------------------------------------------------

    def _add_usage(self, plan: PrefixPlan, prompt: int, cached: int) -> float:
        """Add a request to the group's cumulative token counts; returns the cumulative cached share."""
        def add(usage: dict[str, Any]) -> float:
            g = usage.setdefault(plan.group, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
            g["requests"] += 1
            g["prompt_tokens"] += prompt
            g["cached_tokens"] += cached
            return g["cached_tokens"] / g["prompt_tokens"] if g["prompt_tokens"] else 0.0

        if self.state_dir is None:
            with self._lock:
                return add(self._usage_mem)
        path = self.state_dir / "kb" / self.name / "usage.json"
        with self._lock, _locked(path):  # threads of this process, then other processes
            usage = _read_json(path)
            share = add(usage)
            _write_json(path, usage)
            return share

    def usage(self) -> dict[str, Any]:
        if self.state_dir is None:
            return dict(self._usage_mem)
        return _read_json(self.state_dir / "kb" / self.name / "usage.json")

    def put_document(self, doc: Document) -> None:
        """Add or replace a document; refused before anything is written if a group's prefix would not fit."""
        new = with_document(self.manifest, doc)
        for g in new.document(doc.id).groups:
            self._check_length(plan_prefix(new, self.tok, g))
        self._swap(put_document(self.manifest, doc))

    def delete_document(self, doc_id: str) -> None:
        self._swap(delete_document(self.manifest, doc_id))

    def reload(self) -> None:
        self._swap(load_manifest(self.manifest.root))

    def _swap(self, manifest: Manifest) -> None:
        with self._lock:
            self.manifest = manifest
            self._plans.clear()


@contextmanager
def _locked(path: Path):  # type: ignore[no-untyped-def]
    """An exclusive advisory lock beside path, so concurrent processes update it one at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_json(path: Path) -> dict[str, Any]:
    """A state file's object; a missing or damaged one reads as empty (it is state, rebuilt as used)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)
