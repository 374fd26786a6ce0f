"""The decoding scheduler: how running requests move on once their prompt is in the cache. Token ids only.

`Scheduler` owns what happens after a prefill: choosing a request's first token (`first_token`),
giving a request its drafts from the context (`open`), and stepping running requests together
(`advance`): in groups of at most the checked batch limit (`batch_limit`, `decode.batch_limit`), each
verifying its draft in the rows its group leaves free (`drafts.py`); greedy rows screened through the
int8 copy of the LM head (`greedy_head`, `lmhead.GreedyHead`, among a grammar's allowed tokens where
there is one), sampled ones at low temperatures drawn through it (`GreedyHead.sample`), the others from
the whole head. Whatever
the grouping and the drafts, each request gets exactly the tokens it would get stepped alone.

The engine builds the prefill (`Engine.begin`) and hands the `Decoding` over; the server's worker and
`Engine.generate` call `advance`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvfuse.checkpoints import kept_check
from kvfuse.defaults import cpu_flags, cpu_name
from kvfuse.drafts import DRAFT_TOKENS, Context, DraftLength
from kvfuse.engine.decode import Decoding, Prefilled, Slot, batch_limit, step_rows
from kvfuse.engine.lmhead import SAMPLE_MAX_T, GreedyHead
from kvfuse.engine.sampling import (
    MIN_TEMPERATURE,
    SamplingParams,
    TokenConstraint,
    logprob_of,
    masked,
    sample,
    with_mask,
)
from kvfuse.model import Decoder

log = logging.getLogger(__name__)

MAX_DECODE_BATCH = 16  # the most rows one decoding step may carry (fewer if the check says so)
USUAL_ROWS = 8  # a step's rows for requests and their usual drafts; wider only for drafts in a run (`_drafts`)


def greedy(params: SamplingParams) -> bool:
    """Whether a request's tokens are the argmax of plain logits (what the int8 screen finds exactly)."""
    return params.temperature < MIN_TEMPERATURE and not params.adjusts


def screened_sample(params: SamplingParams) -> bool:
    """Whether a sampled request's tokens may be drawn through the screen (`GreedyHead.sample`): a low
    temperature and no nucleus (its cut needs every probability)."""
    return MIN_TEMPERATURE <= params.temperature <= SAMPLE_MAX_T and params.top_p >= 1.0


class Scheduler:
    """Decoding for one model: the first token, drafts, batched steps. `screen` says whether the model's
    head is one the int8 screen may stand for (a float32 head on the CPU); `draft_tokens` is the longest
    draft a step verifies (0: no drafts)."""

    def __init__(self, model: Decoder, screen: Callable[[], bool], greedy_screen: bool = True,
                 draft_tokens: int = DRAFT_TOKENS) -> None:
        self.model = model
        self._screen = functools.cache(screen)  # the model's precision and device do not change
        self.greedy_screen = greedy_screen  # greedy steps screen the LM head in int8 (see lmhead.py)
        self.screen_kernel: str | None = None  # the screen's kernel (`lmhead.SCREENS`; None: the fastest a step)
        self.screen_samples = True  # sampled steps at low temperatures draw through the screen too
        self.draft_tokens = draft_tokens
        self._draft_keys: np.ndarray | None = None  # drafts match n-grams on these keys (`drafts.token_keys`)
        self._greedy_head: GreedyHead | None | bool = False  # False: not built yet
        self._batch_limit: int | None = None  # batch_limit's checked answer
        self.batch_key: str | None = None  # the model's fingerprint: the check's answer is kept on disk under it

    @property
    def draft_keys(self) -> np.ndarray | None:
        """Each token id's draft key (`drafts.token_keys`), or None: drafts match tokens as they are."""
        return self._draft_keys

    @draft_keys.setter
    def draft_keys(self, keys: np.ndarray | None) -> None:
        vocab = self.model.cfg.vocab_size
        if keys is not None and (keys.ndim != 1 or len(keys) < vocab):
            raise ValueError(f"draft keys must give each of the model's {vocab} token ids a key, got {keys.shape}")
        self._draft_keys = keys

    def greedy_head(self) -> GreedyHead | None:
        """The int8 screen of the LM head for exact greedy steps, built on first use (`Engine.load` uses
        it first; None: not used)."""
        if self._greedy_head is False:
            use = self.greedy_screen and self._screen()
            self._greedy_head = GreedyHead.build(self.model.head_weight(), self.screen_kernel) if use else None
        return self._greedy_head  # type: ignore[return-value]

    def batch_limit(self) -> int:
        """How many rows one step may carry on this model and machine with every answer unchanged, up to
        MAX_DECODE_BATCH (checked once: about a second on Gemma 3 270M)."""
        if self._batch_limit is None:
            def check() -> int:
                with torch.inference_mode():
                    return batch_limit(self.model, MAX_DECODE_BATCH, self.greedy_head())

            if self.batch_key is None or self.model.device.type != "cpu":
                self._batch_limit = check()
            else:  # the answer is the kernels', so it is kept per model, software and machine
                self._batch_limit = kept_check("batch-limits", self._machine_key(), check)
            log.info("decoding steps up to %d rows together", self._batch_limit)
        return self._batch_limit

    def _machine_key(self) -> str:
        """What picks the kernels of a step: the model and its precision (the fingerprint), the screen's
        kernel, torch, the CPU and its flags, and the threads."""
        import hashlib

        head = self.greedy_head()
        parts = (self.batch_key, head.kernel if head is not None else None, torch.__version__,
                 cpu_name(), sorted(cpu_flags()), torch.get_num_threads(), MAX_DECODE_BATCH)
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]

    def first_token(self, pre: Prefilled, params: SamplingParams, gen: torch.Generator | None,
                    record_logits: bool, constraint: TokenConstraint | None = None) -> int:
        """The token after the prompt: the screen's argmax for a greedy request (once the screen is built,
        so that no request pays for the build in its TTFT), drawn through the screen for a sampled one
        that may be, else sampled from the prompt's logits."""
        head = self._greedy_head if not record_logits else None
        if constraint is not None:  # a grammar: its best token screened, else the whole head, masked
            if isinstance(head, GreedyHead) and greedy(params):
                x = self.model.norm(pre.fused.hidden[None])
                return head.argmax_rows(x, allowed=[constraint.allowed(self.model.cfg.vocab_size)])[0]
            return sample(masked(pre.fused.logits, constraint), params, gen)
        if isinstance(head, GreedyHead):
            x = self.model.norm(pre.fused.hidden[None])
            if greedy(params):  # only the argmax is needed: the screen finds it without the float head
                return head.argmax_rows(x)[0]
            if self.screen_samples and screened_sample(params):
                tok = head.sample(x[0], tuple(b[0] for b in head.bounds_rows(x)), params, gen, (),  # type: ignore[arg-type]
                                  self.model.cfg.final_softcap)
                if tok is not None:
                    return tok
        return sample(pre.fused.logits, params, gen)

    def drafts_pay(self) -> bool:
        """Whether drafts pay here: where the layers are float32 or bfloat16 on the CPU (`screen`), a
        step's extra rows cost little (their products read the same weights), and a greedy row's token
        comes from the screen, all rows at once. Any other row (sampled, or greedy with adjusted logits)
        computes the float head's logits only once every draft token before it was taken (`_verify`).
        Elsewhere extra rows are dear: int8's weight-only products are compute-bound, and drafts made its
        quote 1.19x slower (docs/benchmarks.md, issue M)."""
        return self._screen()

    def open(self, d: Decoding, prompt: Sequence[int]) -> None:
        """Let a request without recorded logits draft from its prompt and its own tokens."""
        if self.draft_tokens > 0 and d.steps is None and self.drafts_pay():
            d.context = Context(prompt, d.params.max_tokens, self.draft_keys)
            n = self.draft_tokens
            d.draft_len = DraftLength(most=max(n, MAX_DECODE_BATCH - 1), now=n, usual=n)

    def advance(self, batch: Sequence[Decoding]) -> None:
        """Move every unfinished request in the batch on by at least one token, stepping them together in
        groups of at most `batch_limit()` rows: each gets exactly the tokens it would get stepped alone.
        A greedy request may verify a draft from its context in the same step with the rows its group
        leaves free, and then take several tokens.

        A failure of one request's own (its sampling) ends it with `error` set; a failure of the step
        itself raises."""
        live = [d for d in batch if not d.done]
        drafting = any(d.context is not None for d in live)
        size = self.batch_limit() if len(live) > 1 or drafting else 1
        for at in range(0, len(live), size):
            self._step(live[at : at + size], size)

    def _step(self, live: list[Decoding], rows: int) -> None:
        for d in live:
            if d.slot is None:
                d.slot = Slot(self.model, d.pre.fused.cache, d.params.max_tokens, d.pre.fused.buffers)
        drafts = _drafts(live, rows)
        h = step_rows(self.model, [d.slot for d in live],  # type: ignore[misc]
                      [[d.tokens[-1], *draft] for d, draft in zip(live, drafts, strict=True)])
        spans, at = [], 0  # each request's rows in h
        for draft in drafts:
            spans.append(range(at, at + 1 + len(draft)))
            at += 1 + len(draft)
        # a request with a grammar: each row's mask, the grammar's state after the draft tokens before it
        # (`TokenConstraint.lookahead`); a greedy one is screened among the tokens its rows allow, a
        # sampled one reads the whole head, masked (`_verify`)
        vocab = self.model.cfg.vocab_size
        masks: dict[int, torch.Tensor] = {}
        for j, d in enumerate(live):
            if d.constraint is not None:
                ahead = d.constraint.lookahead(drafts[j], vocab)
                masks.update((r, ahead[min(i, len(ahead) - 1)]) for i, r in enumerate(spans[j]))
        plain = [j for j, d in enumerate(live) if d.steps is None and d.constraint is None]
        screened = [j for j, d in enumerate(live) if d.steps is None and greedy(d.params)]
        drawn = [j for j in plain if self.screen_samples and screened_sample(live[j].params)]
        head = self.greedy_head() if screened or drawn else None
        chosen = _Chosen()  # a greedy row's token, found when the row is read
        bounds: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # row -> (x, a, s): a sampled row's
        if head is not None:  # one screen of the head for every row that reads it
            picked = [r for j in screened for r in spans[j]]
            sampled = [r for j in drawn for r in spans[j]]
            xs = self.model.norm(h[picked + sampled])
            approx = head.screen(xs)
            n = len(picked)
            chosen = _Chosen(head, xs[:n], approx[:n], picked, masks)
            if sampled:
                approx_s, slack_s = head.bounds_rows(xs[n:], approx[n:])
                bounds = {r: (xs[n + i], approx_s[i], slack_s[i]) for i, r in enumerate(sampled)}
        for j, d in enumerate(live):
            try:
                d.take_verified(self._verify(d, h, spans[j], drafts[j], chosen, bounds, head, masks), drafts[j])
            except Exception as e:  # this request's own failure (its sampling): the others go on
                d.fail(e)

    def _verify(self, d: Decoding, h: torch.Tensor, rows: range, draft: Sequence[int], chosen: _Chosen,
                bounds: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                head: GreedyHead | None, masks: dict[int, torch.Tensor]) -> list[int]:
        """The tokens the rows choose, up to the first that differs from the draft. A row that was not
        screened is sampled exactly as a one-token step samples it (its own logits, the tokens before
        it, one draw of the request's generator), and only once every draft token before it was taken.

        For a sampled request this is the standard rejection rule for a draft from the context: the
        draft proposes each token with certainty (q = 1 at x), so x is accepted with probability
        min(1, p(x) / q(x)) = p(x), and a rejection draws from p without x, renormalised, which is
        exactly drawing from p and comparing. Drawn this way, one draw per token taken, a seeded request
        gets the very tokens it gets without drafts. A row of a request with a grammar reads its own mask
        (`masks`): the grammar's state after the draft tokens before it, which are the tokens taken
        before it whenever it is read."""
        toks: list[int] = []
        for i, r in enumerate(rows):
            logits: torch.Tensor | None = None
            drawn = None
            if r in bounds and head is not None:  # drawn through the screen, where its bounds allow
                x, approx, slack = bounds[r]
                drawn = head.sample(x, (approx, slack), d.params, d.gen, [*d.tokens, *toks],
                                    self.model.cfg.final_softcap)
            if r in chosen:
                tok = chosen.token(r)
            elif drawn is not None:
                tok = drawn
            else:
                logits = with_mask(self.model.logits(h[r : r + 1])[0], masks.get(r))
                if d.steps is not None:
                    d.steps.append(logits)
                tok = sample(logits, d.params, d.gen, [*d.tokens, *toks])
            if d.logprobs is not None:  # what it was drawn from (`sampling.logprob_of`), whichever way
                if logits is None:
                    logits = with_mask(self.model.logits(h[r : r + 1])[0], masks.get(r))
                d.logprobs.append(logprob_of(logits, d.params, [*d.tokens, *toks], tok))
            toks.append(tok)
            if i >= len(draft) or tok != draft[i]:
                break
        return toks


class _Chosen:
    """The greedy rows of a step, each row's token the argmax the screen finds exactly (among what its mask
    in `masks` allows), worked out only when `_verify` reads the row: the rows after a draft's first rejected token
    are never read, and their bounds and exact candidates are never computed. The step's one screen of
    the int8 head (`approx`, every row's) is shared; the rest is each row's own arithmetic, the same
    whichever rows are read (`GreedyHead.bounds_rows`)."""

    def __init__(self, head: GreedyHead | None = None, xs: torch.Tensor | None = None,
                 approx: torch.Tensor | None = None, rows: Sequence[int] = (),
                 masks: dict[int, torch.Tensor] | None = None) -> None:
        self.head, self.xs, self.approx, self.masks = head, xs, approx, masks or {}
        self.at = {r: i for i, r in enumerate(rows)}  # step row -> its place in xs

    def __contains__(self, row: int) -> bool:
        return row in self.at

    def token(self, row: int) -> int:
        i = self.at[row]
        assert self.head is not None and self.xs is not None and self.approx is not None
        x = self.xs[i : i + 1]
        return self.head.argmax_rows(x, self.head.bounds_rows(x, self.approx[i : i + 1]), [self.masks.get(row)])[0]


def _drafts(live: list[Decoding], rows: int) -> list[list[int]]:
    """A draft from its context for each request that has one, in a step of at most `rows` rows. Within
    USUAL_ROWS the rows the requests leave are shared out evenly (a draft's first tokens are the likeliest
    to be taken, so every request drafts, not only the first ones); a request whose drafts are being taken
    whole (`DraftLength.copying`) shares in the rest of the step's rows too. Each request may take its share
    of what the requests before it left."""
    out: list[list[int]] = []
    spare = rows - len(live)
    usual = max(0, min(spare, USUAL_ROWS - len(live)))
    drafting = sum(d.context is not None for d in live)
    for d in live:
        assert d.slot is not None  # `_step` gives every request its slot first
        if d.context is None:
            out.append([])
            continue
        share = (spare if d.draft_len.copying else usual) // drafting
        drafting -= 1
        k = min(d.draft_len.now, share, d.params.max_tokens - len(d.tokens) - 1, d.slot.room - 1)
        draft = d.context.propose(k) if k > 0 else []
        spare -= len(draft)
        usual = max(0, usual - len(draft))
        out.append(draft)
    return out
