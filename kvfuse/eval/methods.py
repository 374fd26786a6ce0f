"""Evaluation methods: a small registry of named ways to answer one case.

A method spec is `name` or `name@arg` (blend@0.15, blend@auto, legolink@16). Every fuser that reads
chunk caches (`fuse.FUSERS`) is a method of the same name, its spec parsed by `fuse.parse_spec` (so it
also takes the fuser's options: `queryaware@0.2:behind=head`, `reuse:behind=head`); full,
prefix and the multi-call baselines (mapreduce, maprerank) are this module's own. Every method answers from
the same retrieved chunks, reports the TTFT of its final answer, and teacher-forces full's greedy answer
on its own final prompt cache so fidelity is measured token by token. Built-ins register the same way an
extension would: `@register("name")` on a factory taking the spec's argument.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvfuse.engine.core import Engine, Mode
from kvfuse.engine.sampling import SamplingParams
from kvfuse.eval.data import Case
from kvfuse.fuse import DEFAULT_MODE, FUSERS, Fuser, fuser_key, parse_spec, spec_of
from kvfuse.request import Generation, Ratio, Request
from kvfuse.text import HEAD, Prompt, Tokenizer, complete_answer

MAP_HEAD = (
    "Read the passage below and write one sentence with the facts from it that help answer the "
    "question. If nothing helps, write: nothing.\n\n"
)


@dataclass(slots=True)
class CaseRun:
    """What a method sees for one case."""

    engine: Engine
    tok: Tokenizer
    case: Case
    chunks: tuple[str, ...]  # the retrieved chunk texts, nearest first
    params: SamplingParams
    reference: tuple[int, ...] | None = None  # full's greedy answer ids, teacher-forced by other methods

    def prompt(self, chunks: tuple[str, ...] | None = None) -> Prompt:
        return Prompt(head=HEAD, chunks=self.chunks if chunks is None else chunks, question=self.case.question)


@dataclass(slots=True)
class Outcome:
    answer: str
    ttft_s: float
    scored: torch.Tensor | None  # (len(reference), vocab) teacher-forced logits; full: its step logits
    answer_ids: list[int]
    recomputed_fraction: float  # reused chunk tokens recomputed, in full-layer equivalents (full: 1.0)
    computed_fraction: float  # prompt token-layers computed, over the prompt's (full: 1.0)
    extra: dict[str, object] = field(default_factory=dict)


class Method(Protocol):
    name: str

    def run(self, run: CaseRun) -> Outcome: ...


Factory = Callable[[str | None], Method]
METHODS: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
    def deco(factory: Factory) -> Factory:
        METHODS[name] = factory
        return factory

    return deco


def parse_methods(spec: str) -> list[Method]:
    """'full,blend@0.15,legolink@16' -> methods, in order, without duplicates."""
    out: list[Method] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        base = re.split(r"[@:]", item, maxsplit=1)[0]
        if base not in METHODS:
            raise ValueError(f"unknown method {item!r}; known: {', '.join(sorted(METHODS))} (with @arg where needed)")
        rest = item[len(base):]
        m = METHODS[base](rest.removeprefix("@") or None)  # "@ARG...", or a fuser's ":options" as they are
        if m.name not in {x.name for x in out}:
            out.append(m)
    if not out:
        raise ValueError("--methods is empty; give a comma-separated list such as full,reuse,blend@0.15")
    return out


def _no_arg(name: str, arg: str | None) -> None:
    if arg is not None:
        raise ValueError(f"method {name!r} takes no @argument, got {name}@{arg}")


def _answer(run: CaseRun, req: Request, mode: Mode, ratio: Ratio = None, score: bool = True,
            record: bool = False) -> tuple[str, Generation]:
    stream = run.engine.stream(req, mode, ratio, run.params,
                               score=run.reference if score and run.reference else None, record_logits=record)
    text = complete_answer(stream, run.tok).text
    assert stream.result is not None
    return text, stream.result


def _fractions(g: Generation) -> tuple[float, float]:
    c = g.counts
    recomputed = c.recomputed / c.reused if c.reused else 0.0
    return recomputed, (c.prefilled + c.recomputed) / c.prompt


@dataclass(slots=True)
class Full:
    name: str = "full"

    def run(self, run: CaseRun) -> Outcome:
        req = run.prompt().request(run.tok)
        text, g = _answer(run, req, "full", score=False, record=True)
        assert g.step_logits is not None
        # greedy: the argmax of each step's logits is the token chosen there, the stop token included
        ids = [int(t) for t in g.step_logits.argmax(-1)]
        return Outcome(text, g.ttft_s, g.step_logits, ids, 1.0, 1.0)


@dataclass(slots=True)
class PrefixCaching:
    """Paper-style prefix caching: the head and the first chunk are a cached prefix; the rest is prefilled."""

    name: str = "prefix"

    def run(self, run: CaseRun) -> Outcome:
        req = run.prompt().request(run.tok)
        first = Request(prefix=req.prefix + (req.chunks[0] if req.chunks else ()), suffix=req.suffix)
        run.engine.precompute(first, "prefix")
        text, g = _answer(run, req, "prefix")
        c = g.counts
        return Outcome(text, g.ttft_s, g.scored_logits, g.tokens, 0.0, c.prefilled / c.prompt)


@dataclass(slots=True)
class ChunkReuse:
    """A fuser that reads chunk caches (reuse, blend@R, blend@auto, legolink@K, ...): the caches are
    precomputed and stored, then fused."""

    fuser: Fuser
    ratio: Ratio = None
    name: str = ""

    def run(self, run: CaseRun) -> Outcome:
        req = run.prompt().request(run.tok)
        run.engine.precompute(req, self.fuser)  # stored before the timed request, as in the paper
        text, g = _answer(run, req, self.fuser, self.ratio)
        recomputed, computed = _fractions(g)
        extra: dict[str, object] = {}
        if g.ratio is not None:
            extra["ratio"] = g.ratio
        if g.controller is not None and g.controller.predicted_kl is not None:  # what the calibration promised
            extra["predicted_kl"] = g.controller.predicted_kl
            extra["predicted_kl_bound"] = g.controller.predicted_kl_bound
            extra["meets_target"] = g.controller.meets_target
        return Outcome(text, g.ttft_s, g.scored_logits, g.tokens, recomputed, computed, extra)


@dataclass(slots=True)
class MapReduce:
    """LangChain's MapReduce: summarise each chunk with its own LLM call, then answer over the summaries."""

    summary_tokens: int = 48
    name: str = "mapreduce"

    def run(self, run: CaseRun) -> Outcome:
        tok, spent = run.tok, 0.0
        params = SamplingParams(max_tokens=self.summary_tokens)
        summaries = []
        for chunk in run.chunks:  # the map calls: nothing reusable, each depends on the question
            req = Prompt(head=MAP_HEAD, chunks=(chunk,), question=run.case.question).request(tok)
            req = Request(prefix=req.prefix, chunks=req.chunks, suffix=tuple(
                tok.encode(f"Question: {run.case.question.strip()}\nUseful facts:")))
            stream = run.engine.stream(req, "full", None, params)
            summary = complete_answer(stream, tok).text
            assert stream.result is not None
            spent += stream.result.total_s
            if summary and summary.lower().rstrip(".") != "nothing":
                summaries.append(summary)
        req = run.prompt(tuple(summaries) or run.chunks[:1]).request(tok)
        text, g = _answer(run, req, "full")
        return Outcome(text, spent + g.ttft_s, g.scored_logits, g.tokens, 0.0, 1.0,
                       {"map_calls": len(run.chunks), "summaries": summaries})


@dataclass(slots=True)
class MapRerank:
    """LangChain's MapRerank: answer from each chunk alone, score each answer, keep the best.

    The score is the answer's mean token log-probability (a base model cannot be trusted to print a
    calibrated score of its own). The first token of the kept answer exists only once every call is done."""

    name: str = "maprerank"

    def run(self, run: CaseRun) -> Outcome:
        best: tuple[float, str, Request, Generation] | None = None
        spent = 0.0
        for chunk in run.chunks:
            req = run.prompt((chunk,)).request(run.tok)
            text, g = _answer(run, req, "full", score=False, record=True)
            spent += g.total_s
            assert g.step_logits is not None
            lp = torch.log_softmax(g.step_logits, -1).max(-1).values  # greedy: the chosen tokens' logprobs
            score = float(lp.mean())
            if best is None or score > best[0]:
                best = (score, text, req, g)
        assert best is not None
        _, text, req, g = best
        scored = None
        if run.reference:  # untimed: teacher-force full's answer on the kept chunk's prompt
            scored = run.engine.generate(req, "full", None, SamplingParams(max_tokens=1), score=run.reference
                                         ).scored_logits
        return Outcome(text, spent, scored, g.tokens, 0.0, 1.0, {"score": best[0]})


def _full(arg: str | None) -> Method:
    _no_arg("full", arg)
    return Full()


def _prefix(arg: str | None) -> Method:
    _no_arg("prefix", arg)
    return PrefixCaching()


def _mapreduce(arg: str | None) -> Method:
    _no_arg("mapreduce", arg)
    return MapReduce()


def _maprerank(arg: str | None) -> Method:
    _no_arg("maprerank", arg)
    return MapRerank()


def _fusing(name: str) -> Factory:
    def make(arg: str | None) -> Method:  # arg: what followed NAME@ (options included), or ":options"
        spec = name if arg is None else name + (arg if arg.startswith(":") else "@" + arg)
        fuser, ratio = parse_spec(spec)
        return ChunkReuse(fuser, ratio, spec_of(fuser, ratio))

    return make


@dataclass(slots=True)
class Default:
    """`default`: the default fuser (`fuse.DEFAULT_MODE`) at its calibrated ratio when the engine's
    controller has a calibration of it (ratio auto), else at its default ratio; reported as `default`."""

    name: str = "default"

    def run(self, run: CaseRun) -> Outcome:
        fuser = run.engine.fuser(DEFAULT_MODE)  # its model-dependent options settled
        ctl = run.engine.controller
        calibrated = ctl is not None and ctl.calibration is not None and \
            ctl.calibration.floor(fuser_key(fuser)) is not None
        out = ChunkReuse(fuser, "auto" if calibrated else None, self.name).run(run)
        out.extra["fuser"] = spec_of(fuser)
        return out


def _default(arg: str | None) -> Method:
    _no_arg("default", arg)
    return Default()


register("default")(_default)
register("full")(_full)
register("prefix")(_prefix)
for _name, _cls in FUSERS.items():
    if _cls.reads == "chunks":
        register(_name)(_fusing(_name))
register("mapreduce")(_mapreduce)
register("maprerank")(_maprerank)
