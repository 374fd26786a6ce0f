"""Choosing the next token: the logits adjusted (OpenAI's logit_bias, presence and frequency penalties),
then greedy, or temperature with nucleus (top-p) sampling."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvfuse.request import TokenLogprob

MIN_TEMPERATURE = 1e-4
MAX_BIAS = 100.0  # OpenAI's range for logit_bias values; -100 bans a token, +100 all but forces it
MAX_PENALTY = 2.0  # and for presence_penalty and frequency_penalty
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS ids
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    presence_penalty: float = 0.0  # subtracted once from each token already generated
    frequency_penalty: float = 0.0  # subtracted per time each token was already generated
    logprobs: int | None = None  # report each token's log-probability and this many alternatives (None: no)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs takes 0 to {MAX_TOP_LOGPROBS} alternatives, got {self.logprobs}")
        for tok, bias in self.logit_bias:
            if tok < 0 or not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ValueError(f"logit_bias takes token ids >= 0 and biases between -{MAX_BIAS:g} and "
                                 f"{MAX_BIAS:g}, got {tok}: {bias}")

    @property
    def adjusts(self) -> bool:
        """Whether the logits are changed before choosing (then a greedy step needs every logit)."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def adjusted(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int] = ()) -> torch.Tensor:
    """The logits (vocab,) with the bias added and the penalties for the tokens generated so far taken
    off, as OpenAI defines them: logit[t] - count[t] * frequency - (count[t] > 0) * presence + bias[t]."""
    if not params.adjusts:
        return logits
    out = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=out.device)
        out.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], device=out.device))
    if generated and (params.presence_penalty or params.frequency_penalty):
        counts = Counter(generated)
        ids = torch.tensor(list(counts), device=out.device)
        n = torch.tensor(list(counts.values()), dtype=torch.float32, device=out.device)
        out.index_add_(0, ids, -(n * params.frequency_penalty + params.presence_penalty))
    return out


class TokenConstraint(Protocol):
    """What may come next, over token ids (a grammar compiled for the tokenizer, `server/grammar.py`):
    the engine masks every other token before choosing, and tells it each token taken."""

    def allowed(self, vocab: int) -> torch.Tensor:
        """(vocab,) bool: the tokens that may come next."""
        ...

    def advance(self, token: int) -> None:
        """The token was taken."""
        ...

    def finished(self) -> bool:
        """Nothing more may follow: the answer is complete."""
        ...

    def lookahead(self, tokens: Sequence[int], vocab: int) -> list[torch.Tensor]:
        """The masks (`allowed`) before tokens[0], and after each of tokens it accepts in a row while
        its answer is not complete (a draft's rows: one more mask than tokens accepted, at most one per
        token); the state is left as it was."""
        ...


def masked(logits: torch.Tensor, constraint: TokenConstraint | None) -> torch.Tensor:
    """The logits with every token the constraint forbids at -inf (as they are, without one)."""
    if constraint is None:
        return logits
    return with_mask(logits, constraint.allowed(logits.shape[-1]))


def with_mask(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """The logits with every token outside `allowed` ((vocab,) bool) at -inf (as they are for None)."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def logprob_of(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int], token: int) -> TokenLogprob:
    """The token's log-probability under the distribution it was drawn from: the logits after
    logit_bias and the penalties, over the temperature when it is above 0 (a greedy choice: at
    temperature 1, as OpenAI reports it). top_p's cut is not applied: a token outside the nucleus keeps
    its finite log-probability, though it is never drawn. Alternatives come sorted, most likely first."""
    t = params.temperature if params.temperature >= MIN_TEMPERATURE else 1.0
    lp = torch.log_softmax(adjusted(logits.float(), params, generated) / t, dim=-1)
    top = torch.topk(lp, params.logprobs) if params.logprobs else None
    pairs = tuple((t, v) for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
                  if v != float("-inf")) if top is not None else ()  # a grammar's forbidden tokens are no alternatives
    return TokenLogprob(token, float(lp[token]), pairs)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           generated: Sequence[int] = ()) -> int:
    """Pick a token id from next-token logits (vocab,), after `generated` tokens of this completion (on
    the generator's device, when one is given)."""
    if generator is not None:
        logits = logits.to(generator.device)
    logits = adjusted(logits, params, generated)
    if params.temperature < MIN_TEMPERATURE:  # 0 means greedy; tinier ones would overflow the softmax
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep the smallest set whose mass reaches top_p (the first token is always kept)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p
        drop[0] = False  # explicitly: a top_p below float32's range compares as 0 and would drop it too
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
