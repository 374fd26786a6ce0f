"""A planned completion on the worker: build the kb prefix if needed, prefill, then one token per
decoding step (shared with the other running requests), text deltas with stop strings, citations
and metrics at the end."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvfuse.engine import Decoding, Generation
from kvfuse.engine import Request as EngineRequest
from kvfuse.kb.base import KnowledgeBase
from kvfuse.kb.prefix import PrefixPlan
from kvfuse.kb.quotes import Citation, find_quote, usable
from kvfuse.sampling import SamplingParams
from kvfuse.server.schemas import KvfuseOptions
from kvfuse.text import TextDeltas

if TYPE_CHECKING:
    from kvfuse.server.app import ServerState

log = logging.getLogger(__name__)


@dataclass
class Planned:
    request: EngineRequest
    mode: str
    ratio: float | str | None
    params: SamplingParams
    stops: list[str]
    kb: KnowledgeBase | None
    group: str | None
    tenant: str | None
    opts: KvfuseOptions
    question: str
    plan_tokens: int = 0  # how much of the request's prefix is the knowledge base's (0: none)


@dataclass
class Outcome:
    text: str
    result: Generation
    finish_reason: str
    citations: list[Citation]
    cancelled: bool
    built_tokens: int = 0  # knowledge-base prefix tokens computed for this request (cold cache)
    build_s: float = 0.0


class Generating:
    """One completion as a worker `Stepper`: made on the worker thread (kb build, prefill, first token),
    then `stepped()` after every decoding step, then `finish()`."""

    def __init__(self, state: ServerState, p: Planned, cancel: threading.Event, emit: Any, streaming: bool) -> None:
        self.state, self.cancel, self.emit, self.streaming = state, cancel, emit, streaming
        self.built, self.build_s = 0, 0.0
        if cancel.is_set():
            raise asyncio.CancelledError()
        kb, group = p.kb, p.group
        self.plan: PrefixPlan | None = None  # the knowledge base as this request reads it (citations, usage)
        if kb is not None and group is not None:
            plan = kb.plan(group, p.tenant)
            req = p.request
            if plan.ids != req.prefix[: p.plan_tokens]:  # the knowledge base was edited after this request was planned
                tenant = [s for s in req.salts if s.key.startswith("tenant:") and s.end > len(req.prefix)]
                moved = [replace(s, start=len(plan.ids)) for s in tenant]
                req = replace(req, prefix=plan.ids + req.prefix[p.plan_tokens :], salts=plan.salts + tuple(moved))
                p = replace(p, request=req, plan_tokens=len(plan.ids))
            report = kb.ensure_built(group, p.tenant)
            if report is not None:
                self.built, self.build_s = report.tokens_recomputed, report.build_s
            self.plan = plan
        self.p = p
        self.deltas = TextDeltas(state.tok, p.stops)
        self.pieces: list[str] = []
        self.decoding: Decoding = state.engine.begin(p.request, p.mode, p.ratio, p.params)
        self.stepped()

    @property
    def done(self) -> bool:
        return self.decoding.done or self.deltas.stopped or self.cancel.is_set()

    def stepped(self) -> None:
        """Turn the tokens generated since the last call into text, and stream it."""
        if self.decoding.error is not None:
            raise self.decoding.error
        tokens, seen = self.decoding.tokens, self.deltas.ids  # the text so far covers `seen`
        while len(seen) < len(tokens) and not self.deltas.stopped:
            self._out(self.deltas.push(tokens[len(seen)]))

    def _out(self, delta: str) -> None:
        if delta:
            self.pieces.append(delta)
            if self.streaming:
                self.emit("delta", delta)

    def abort(self) -> None:
        self.decoding.close()

    def finish(self) -> Outcome:
        """Close the generation, release any held-back text, then cite and count."""
        result = self.decoding.close()
        cancelled = self.cancel.is_set()
        p, state = self.p, self.state
        if not cancelled:
            self._out(self.deltas.flush())
        text = "".join(self.pieces)
        stopped_by_string = self.deltas.stopped
        citations: list[Citation] = []
        if self.plan is not None and not cancelled:
            try:
                citations = _citations(p, self.plan, text)
            except Exception:  # a failed citation must not cost the answer
                log.exception("citations failed")
        c = result.counts
        cached = max(0, c.cached - self.built)
        state.metrics.observe(result.ttft_s + self.build_s, c.prompt, cached, c.recomputed, len(result.tokens))
        if p.kb is not None and self.plan is not None:
            p.kb._add_usage(self.plan, c.prompt, cached)
        hit_limit = len(result.tokens) >= p.params.max_tokens and result.finish_reason == "length"
        finish = "length" if hit_limit and not stopped_by_string else "stop"
        return Outcome(text, result, finish, citations, cancelled, self.built, self.build_s)


def _citations(p: Planned, plan: PrefixPlan, text: str) -> list[Citation]:
    """Quotes inside the answer, verified; else a supporting passage found by retrieval (labelled so)."""
    assert p.kb is not None and p.group is not None
    if p.opts.quote:
        prep = p.kb.prepare(p.question, p.group, p.tenant)
        return p.kb.cite(p.question, text.strip(), prep)
    quoted = [q for q in re.findall(r"[\"“]([^\"”]+)[\"”]", text) if usable(q)]
    found = [find_quote(q, plan.documents) for q in quoted]
    if any(c.verified for c in found):
        return found
    support = p.kb.supporting_passage(f"{p.question} {text}", plan.documents)
    return found + ([support] if support is not None else [])
