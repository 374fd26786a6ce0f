"""The one answer pipeline over a knowledge base: prepare, warm, ask, cite, finish. `kvfuse ask`, the
demo, `compare` and the server all answer through it.

prepare  a question (or a server's own suffix ids) against a group's prefix plan, as an engine request:
         the plan's ids (plus anything the caller places after them, a chat's turns), retrieved passages
         and request documents fused as chunks, and the salts of the group and tenant (everything
         the request brings is its tenant's and group's own, `Salt.of_owner`). Pure planning:
         nothing is computed, so the server plans on its HTTP threads.
warm     builds the prefix if some block is missing and precomputes the chunk caches (the server does
         this as a barrier job, never inside a running batch); returns the tokens written.
ask      prepare, warm, answer from the cached prefix, cite, finish.
cite     verifies the model's quotes against the sources, else a sentence found by search, labelled so;
         judges whether each one supports the answer (`kb.facts`).
review   cite, and the conflicts: passages that state another value of a quantity the answer states
         (`kb.conflicts`).
finish   token accounting, cost, and the group's cumulative usage.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvfuse.defaults import ANSWER_TOKENS
from kvfuse.engine.sampling import SamplingParams, TokenConstraint
from kvfuse.fuse.registry import default_mode, residual_layer
from kvfuse.kb.conflicts import Conflict, conflicts_for
from kvfuse.kb.manifest import Document, KBError
from kvfuse.kb.prefix import PrefixPlan
from kvfuse.kb.quotes import Citation, find_quote, judge, looping, no_usable_quote, sentence_around, usable
from kvfuse.rag.index import IndexChunk
from kvfuse.request import Generation, Ratio, Request, Salt, owned_request
from kvfuse.text.deltas import complete_answer
from kvfuse.text.layout import chunk_text, question_text

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kvfuse.engine.core import Engine
    from kvfuse.kb.state import KBState
    from kvfuse.text.tokenizer import Tokenizer

QUOTE_TOKENS = 48  # a quote is at most a sentence; one that runs past this is no usable quote
QUOTE_STOPS = ('"', "”", "\n")


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
    finish_reason: str = "stop"  # "length": the answer hit max_tokens and may be cut short
    ratio: float | None = None
    fuser: str = ""  # the mode with its options (`fuse.spec_of`), e.g. queryaware:behind=self
    conflicts: list[Conflict] = field(default_factory=list)  # passages that state another value (kb.conflicts)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["citations"] = [c.as_dict() for c in self.citations]
        out["conflicts"] = [c.as_dict() for c in self.conflicts]
        out.pop("ratio")  # not part of `ask --json`'s contract (the server reports it under kvfuse.ratio)
        return out


@dataclass(frozen=True, slots=True)
class Prepared:
    """A question turned into an engine request against a group's prefix plan, with what made it (so it
    can be prepared again when the knowledge base changes before it runs)."""

    plan: PrefixPlan
    request: Request
    mode: str
    ratio: Ratio
    question: str
    passages: tuple[IndexChunk, ...] = ()
    documents: tuple[tuple[int, ...], ...] = ()  # the request's own documents' ids
    suffix: tuple[int, ...] | None = None
    after_prefix: tuple[int, ...] = ()
    tenant_wide: bool = False  # the request's own entries are salted per tenant, not per tenant and group

    @property
    def sources(self) -> list[Document]:
        """What an answer may quote: the group's documents and the fused passages."""
        return list(self.plan.documents) + [Document(c.doc_id, c.title, "", 0, c.groups, False, c.text)
                                            for c in self.passages]


def prepare(kb: KBState, question: str, group: str, tenant: str | None = None,
            passages: Sequence[IndexChunk] = (), ratio: Ratio = None, *, suffix: Sequence[int] | None = None,
            after_prefix: Sequence[int] = (), documents: Sequence[Sequence[int]] = (), mode: str | None = None,
            tenant_wide: bool = False) -> Prepared:
    """Plan a request on the group's prefix; see the module docstring. `documents` are the request's own
    documents as the token ids of their chunk text (`text.layout.chunk_text`), tokenised once by the
    caller. Raises KBError on bad input."""
    if suffix is None and not question.strip():
        raise KBError("the question is empty")
    plan = kb.plan(group, tenant)
    kb.note_read(group, tenant)
    for c in passages:
        if c.groups and group not in c.groups:
            raise KBError(f"chunk of {c.doc_id!r} is not readable by group {group!r}")
    tok = kb.tok
    suffix_ids = tuple(suffix) if suffix is not None else tuple(tok.encode(question_text(question)))
    chunks = tuple(tuple(tok.encode(chunk_text(c.headed))) for c in passages) + tuple(tuple(d) for d in documents)
    kb.check_length(plan, len(after_prefix) + len(suffix_ids) + sum(len(c) for c in chunks))
    # everything after the knowledge base is the group's own (a chat's turns, documents): salted so
    req = owned_request(plan.ids, suffix_ids, after=after_prefix, chunks=chunks, head_salts=plan.salts,
                        owner=Salt.of_owner(tenant, group, kb.name, tenant_wide))
    mode = default_mode(mode, bool(chunks))
    return Prepared(plan, req, mode, ratio if chunks else None, question, tuple(passages),
                    tuple(tuple(d) for d in documents),
                    tuple(suffix) if suffix is not None else None, tuple(after_prefix), tenant_wide)


def refresh(kb: KBState, prep: Prepared) -> Prepared:
    """The same question prepared on the knowledge base as it is now (it may have been edited since)."""
    if kb.plan(prep.plan.group, prep.plan.tenant) is prep.plan:
        return prep
    return prepare(kb, prep.question, prep.plan.group, prep.plan.tenant, prep.passages, prep.ratio,
                   suffix=prep.suffix, after_prefix=prep.after_prefix, documents=prep.documents, mode=prep.mode,
                   tenant_wide=prep.tenant_wide)


def needs_warming(kb: KBState, prep: Prepared) -> bool:
    """The prefix has a block that is not stored (a cold build)."""
    from kvfuse.kb.build import needs_build

    return needs_build(kb, prep.plan)


def warm(kb: KBState, prep: Prepared, chunks: bool = True) -> tuple[int, float]:
    """Build the prefix where a block is missing and, with `chunks`, precompute the chunk caches.
    Returns (tokens written, seconds spent on the prefix build)."""
    from kvfuse.kb.build import build, needs_build

    written, build_s = 0, 0.0
    if needs_build(kb, prep.plan):
        report = build(kb, prep.plan)
        written, build_s = report.tokens_recomputed, report.build_s
    if chunks and prep.request.chunks:
        eng, req = kb.engine, prep.request
        fuser = eng.fuser(prep.mode)
        behind = eng.cache.chunk_preambles(fuser, req)  # what the mode's caches are computed behind
        residual = residual_layer(fuser)
        written += sum(len(c) for c, p in zip(req.chunks, behind, strict=True)
                       if eng.cache.chunk_key(c, req.chunk_salt, p, residual) not in eng.store)
        eng.precompute(req, prep.mode)
    return written, build_s


def ask(kb: KBState, question: str, group: str, tenant: str | None = None,
        passages: Sequence[IndexChunk] = (), ratio: Ratio = None, max_tokens: int = ANSWER_TOKENS,
        quote: bool = True, constraint: TokenConstraint | None = None) -> Answer:
    """Prepare, warm, answer from the cached prefix (under `constraint`, a grammar, where given), cite,
    finish."""
    prep = prepare(kb, question, group, tenant, passages, ratio)
    written, _ = warm(kb, prep)
    stream = kb.engine.stream(prep.request, prep.mode, prep.ratio, SamplingParams(max_tokens=max_tokens),
                              constraint=constraint)
    done = complete_answer(stream, kb.tok)
    assert stream.result is not None
    answered = finish(kb, prep, done.text, stream.result, [], written, stopped=done.stopped)
    citations, conflicts = review(kb, prep, done.text, ask_model=quote)
    return replace(answered, citations=citations, conflicts=conflicts)


def review(kb: KBState, prep: Prepared, answer: str, ask_model: bool = True,
           tolerant: bool = False) -> tuple[list[Citation], list[Conflict]]:
    """A finished answer's citations (each judged: does it support the answer?) and its conflicts. With
    `tolerant` (the server: the answer is already sent), a check that fails is logged and gives none,
    and never costs the answer or the other check."""
    checks: list[Callable[[], Any]] = [lambda: cite(kb, prep, answer, ask_model),
                                       lambda: conflicts_for(kb, prep.plan.group, prep.question, answer)]
    out: list[Any] = []
    for name, check in zip(("citations", "the conflict check"), checks, strict=True):
        try:
            out.append(check())
        except Exception:
            if not tolerant:
                raise
            log.exception("%s failed", name)
            out.append([])
    return out[0], out[1]


def cite(kb: KBState, prep: Prepared, answer: str, ask_model: bool = True) -> list[Citation]:
    """With ask_model, ask the model for a verbatim quote (a second, cached request); else take the
    quotes inside the answer. Quotes are verified against the sources; where none is, a sentence found
    by search is added, labelled as retrieved (see `kb.quotes` for the states)."""
    answer = answer.strip()
    if ask_model:
        found = [quote_citation(_model_quote(kb, prep, answer), prep.sources)] if answer else []
    else:
        found = [find_quote(q, prep.sources) for q in re.findall(r"[\"“]([^\"”]+)[\"”]", answer) if usable(q)]
    sources = prep.sources
    return [judge(c, answer, sources) for c in with_support(found, sources, f"{prep.question} {answer}",
                                                                only_verified=ask_model)]


@dataclass(frozen=True, slots=True)
class QuoteAttempt:
    text: str
    closed: bool  # it ended at a closing quotation mark (or the end of a line), not at the length bound


def ask_quote(engine: Engine, tok: Tokenizer, req: Request, mode: str, ratio: Ratio = None) -> QuoteAttempt:
    """Run a request whose suffix ends in `Quote: "` and read the quote, at most a sentence long."""
    stream = engine.stream(req, mode, ratio, SamplingParams(max_tokens=QUOTE_TOKENS))
    done = complete_answer(stream, tok, QUOTE_STOPS)
    return QuoteAttempt(done.text, done.stopped)


def quote_text(question: str, answer: str) -> str:
    """The quote request's suffix: the question, then the answer and `Quote: "`."""
    return question_text(question) + f" {answer}\nQuote: \""


def quote_request(tok: Tokenizer, req: Request, question: str, answer: str) -> Request:
    """The quote request: the answer's own prompt with `quote_text` as its suffix."""
    return replace(req, suffix=tuple(tok.encode(quote_text(question, answer))))


def quote_citation(attempt: QuoteAttempt, sources: Sequence[Document]) -> Citation:
    """The model's quote checked against the sources; a loop, or one with no closing mark within a
    sentence's length, or a too short one, is no usable quote."""
    if not attempt.closed or looping(attempt.text) or not usable(attempt.text):
        return no_usable_quote(attempt.text)
    return find_quote(attempt.text, sources)


def with_support(found: list[Citation], sources: Sequence[Document], query: str,
                 only_verified: bool = True) -> list[Citation]:
    """The verified quotes (all quotes, unless only_verified); without one, what search found is added."""
    if any(c.verified for c in found):
        return [c for c in found if c.verified] if only_verified else found
    support = supporting_passage(query, sources)
    return found + ([support] if support is not None else [])


def _model_quote(kb: KBState, prep: Prepared, answer: str) -> QuoteAttempt:
    """The model's quote, asked on the group's prefix and the fused passages (a chat's turns and request
    documents are left out: the quote must come from the knowledge)."""
    q = prepare(kb, prep.question, prep.plan.group, prep.plan.tenant, prep.passages, prep.ratio,
                suffix=kb.tok.encode(quote_text(prep.question, answer)), tenant_wide=prep.tenant_wide)
    return ask_quote(kb.engine, kb.tok, q.request, q.mode, q.ratio)


def supporting_passage(query: str, docs: Sequence[Document]) -> Citation | None:
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


def finish(kb: KBState, prep: Prepared, text: str, result: Generation, citations: list[Citation],
           written: int = 0, built: int = 0, stopped: bool = False, conflicts: Sequence[Conflict] = ()) -> Answer:
    """Token accounting, cost and the cumulative cached share of a finished answer. `built` prefix tokens
    were computed for this very request (a cold build), so they count as computed, not cached; `stopped`
    says a stop string ended the text (else the engine's finish reason stands)."""
    c = result.counts
    cached = max(0, c.cached - built)
    computed = c.prompt - cached
    share = cached / c.prompt if c.prompt else 0.0
    cost = kb.costs.request(written, cached, computed)
    cumulative = kb.usage_log.add(prep.plan.group, c.prompt, cached, cost["total"])
    return Answer(
        text, result.ttft_s, {"prompt": c.prompt, "cached": cached, "computed": computed}, round(share, 4),
        cost, citations, prep.plan.group, prep.plan.version, prep.mode,
        round(cumulative, 4), [ch.doc_id for ch in prep.passages],
        result.controller.as_dict() if result.controller is not None else None, c.recomputed,
        "stop" if stopped else result.finish_reason, result.ratio, result.fuser, list(conflicts),
    )
