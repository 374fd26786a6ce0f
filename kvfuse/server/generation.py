"""A planned completion on the worker: prefill, then one token per decoding step (shared with the other
running requests), text deltas with stop strings, and at the end citations, usage and metrics through
the knowledge base's answer pipeline (`kb.answer`), the same code as `kvfuse ask`."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from kvfuse.engine.decode import Decoding
from kvfuse.kb import answer
from kvfuse.kb.quotes import Citation
from kvfuse.request import Generation, TokenLogprob
from kvfuse.server import logprobs as lp
from kvfuse.server.planning import Planned
from kvfuse.server.state import ServerState
from kvfuse.text.deltas import TextDeltas

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    text: str
    result: Generation
    finish_reason: str
    citations: list[Citation]
    cancelled: bool
    answer: answer.Answer | None = None  # knowledge-base requests: the pipeline's accounting
    built_tokens: int = 0  # knowledge-base prefix tokens computed for this request (cold cache)
    build_s: float = 0.0
    client_ttft_s: float = 0.0  # from the request's arrival to its first token: queue and planning included
    queue_s: float = 0.0  # from arrival to its start on the worker (a cold build before it included)
    logprobs: list[TokenLogprob] | None = None  # the text's tokens', where asked

    @property
    def cached(self) -> int:
        """Prompt tokens read from the cache (a prefix built for this request was computed, not cached)."""
        return self.answer.tokens["cached"] if self.answer else max(0, self.result.counts.cached - self.built_tokens)

    def usage(self) -> dict[str, Any]:
        c, n = self.result.counts, len(self.result.tokens)
        return {"prompt_tokens": c.prompt, "completion_tokens": n, "total_tokens": c.prompt + n,
                "prompt_tokens_details": {"cached_tokens": self.cached}}

    def kvfuse(self, p: Planned) -> dict[str, Any]:
        r, c = self.result, self.result.counts
        return {"ttft_s": round(r.ttft_s + self.build_s, 6), "client_ttft_s": round(self.client_ttft_s, 6),
                "queue_s": round(self.queue_s, 6), "mode": p.mode, "fuser": r.fuser, "ratio": r.ratio,
                "recomputed_tokens": c.recomputed, "kb_build_s": round(self.build_s, 6),
                "cached_token_share": round(self.cached / c.prompt, 4) if c.prompt else 0.0,
                "controller": r.controller.as_dict() if r.controller is not None else None,
                "citations": [x.as_dict() for x in self.citations],
                "conflicts": [x.as_dict() for x in self.answer.conflicts] if self.answer else [],
                "cost_units": self.answer.cost_units if self.answer else None,
                "kb": p.kb.name if p.kb else None,
                "group": p.prep.plan.group if p.prep else None,
                "drafts": {"steps": r.drafts.steps, "drafted": r.drafts.drafted, "accepted": r.drafts.accepted}}


class Generating:
    """One completion as a worker `Stepper`: made on the worker thread (prefill, first token), then
    `stepped()` after every decoding step, then `finish()`. A knowledge-base request is prepared again
    if the knowledge base changed since it was planned (edits are barrier jobs, so it cannot change
    while the request runs); its cold build already ran as a barrier job before it started."""

    def __init__(self, state: ServerState, p: Planned, cancel: threading.Event, emit: Any, streaming: bool) -> None:
        self.state, self.cancel, self.emit, self.streaming = state, cancel, emit, streaming
        self.started = time.perf_counter()
        if cancel.is_set():
            raise asyncio.CancelledError()
        if p.kb is not None and p.prep is not None:
            prep = answer.refresh(p.kb, p.prep)
            p = replace(p, prep=prep, request=prep.request)
        self.p = p
        self.deltas = TextDeltas(state.tok, p.stops, lead_in=p.opts.question is not None)  # as `kvfuse ask`
        self.pieces: list[str] = []
        self.lp_sent = 0  # tokens whose logprobs went out with a delta
        self.decoding: Decoding = state.engine.begin(p.request, p.mode, p.ratio, p.params, pause=state.worker.pause,
                                                     constraint=p.grammar)
        self.first_at = time.perf_counter()
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
        """Keep a piece of text and stream it, with the logprobs of the tokens read since the last one
        (where asked): ("delta", (text, [TokenLogprob], tokens before them))."""
        if delta:
            self.pieces.append(delta)
            if self.streaming:
                entries, before = self._logprobs_since()
                self.emit("delta", (delta, entries, before))

    def _logprobs_since(self) -> tuple[list[TokenLogprob], list[int]]:
        read, lps = len(self.deltas.ids), self.decoding.logprobs
        if lps is None:
            return [], []
        before = self.decoding.tokens[max(0, self.lp_sent - lp.CONTEXT) : self.lp_sent]  # what their texts need
        entries, self.lp_sent = lps[self.lp_sent : read], read
        return entries, before

    def abort(self) -> None:
        self.decoding.close()

    def finish(self) -> Outcome:
        """Close the generation, release any held-back text, then cite and count."""
        result = self.decoding.close()
        cancelled = self.cancel.is_set()
        p = self.p
        if not cancelled:
            self._out(self.deltas.flush())
        text = "".join(self.pieces)
        citations: list[Citation] = []
        conflicts: list[answer.Conflict] = []
        done: answer.Answer | None = None
        if p.kb is not None and p.prep is not None:
            if not cancelled:  # a failed check must not cost the answer, nor the other check
                citations, conflicts = answer.review(p.kb, p.prep, text, ask_model=p.opts.quote, tolerant=True)
            done = answer.finish(p.kb, p.prep, text, result, citations, p.built, p.built, conflicts=conflicts)
        out = Outcome(text, result, self._finish_reason(result), citations, cancelled, done, p.built, p.build_s,
                      self.first_at - p.arrived, self.started - p.arrived,
                      result.logprobs[: len(self.deltas.ids)] if result.logprobs is not None else None)
        c = result.counts
        self.state.metrics.observe(result.ttft_s + p.build_s, out.client_ttft_s, c.prompt, out.cached, c.recomputed,
                                   len(result.tokens))
        return out

    def _finish_reason(self, result: Generation) -> str:
        hit_limit = len(result.tokens) >= self.p.params.max_tokens and result.finish_reason == "length"
        return "length" if hit_limit and not self.deltas.stopped else "stop"
