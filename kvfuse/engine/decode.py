"""Incremental decoding: one new token per sequence per step, several sequences in one step, and a
request's decoding state (`Decoding`, from its first token to its `Generation`).

Each sequence keeps its own cache (`Slot`). A step (`step_hidden`) runs the layers' projections and
MLPs for every sequence's new token as one matrix, so the weights are read once for the whole batch;
on a CPU decoding is memory-bound, and four sequences step in well under twice the time of one. Each
sequence's attention runs over its own cache.

Batching must not change answers: a request must decode to the same tokens alone or beside others.
A row of a float32 matrix product depends only on its own input row, but the order of its sums
depends on the kernel, which the BLAS picks by shape: on x86, one row takes a matrix-vector path that
sums differently from the products of several rows. So a step always runs at least MIN_ROWS rows (a lone
sequence gets a zero row beside it), and `batch_limit` checks on the model and machine at hand up to
how many rows every row's result is bitwise the same as in a MIN_ROWS step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

from kvfuse.drafts import Context, DraftLength, DraftStats
from kvfuse.engine.lmhead import GreedyHead
from kvfuse.engine.sampling import SamplingParams, TokenConstraint, masked
from kvfuse.fuse import Fused
from kvfuse.kv import KVCache
from kvfuse.model import Decoder, RowPlan
from kvfuse.policy import Decision
from kvfuse.request import Generation, TokenCounts, TokenLogprob
from kvfuse.store.tiered import StoreStats

MIN_ROWS = 2  # a step runs at least this many rows: see the module docstring


class Slot:
    """A sequence's cache during decoding: the prompt's K/V plus room for max_new tokens.

    `buffers` are the prefill's own (`Fused.buffers`): decoding appends to them in place. Without them
    (or with too little room) the cache is copied into new buffers first."""

    def __init__(
        self, model: Decoder, cache: KVCache, max_new: int, buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        cfg = model.cfg
        self.n = len(cache)
        cap = self.n + max_new
        if buffers is not None and buffers[0].shape[2] >= cap:
            self.k, self.v = buffers
        else:
            shape = (cfg.num_layers, cfg.num_kv_heads, cap, cfg.head_dim)  # (layers, kv_heads, T, head_dim)
            self.k = torch.empty(shape, dtype=cache.k.dtype)
            self.v = torch.empty(shape, dtype=cache.v.dtype)
            self.k[:, :, : self.n], self.v[:, :, : self.n] = cache.k, cache.v

    @property
    def room(self) -> int:
        return int(self.k.shape[2]) - self.n

    def rewind(self, n: int) -> None:
        """Forget the last n positions (a draft's rejected rows); later steps overwrite their K/V."""
        if not 0 <= n <= self.n:
            raise ValueError(f"cannot rewind {n} of {self.n} positions")
        self.n -= n


def step_hidden(model: Decoder, slots: list[Slot], tokens: list[int]) -> torch.Tensor:
    """Feed tokens[j] to slots[j] at its next position; returns the last hidden states (len(slots), hidden),
    before the final norm. Every slot needs room for one more token."""
    if len(slots) != len(tokens):
        raise ValueError(f"one token per slot: {len(tokens)} tokens for {len(slots)} slots")
    return step_rows(model, slots, [[t] for t in tokens])


def step_rows(model: Decoder, slots: list[Slot], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
    """Feed tokens[j] (one or more) to slots[j] at its next positions; returns the hidden states before the
    final norm, (total tokens, hidden), slot by slot in order. Slot j needs room for len(tokens[j]).

    All rows share the step's matrix products; each row's attention scores are a call of its own over
    its slot's cache up to and including its own position, the call a step of that token alone makes,
    and on a full-attention layer a slot's rows share the product of their weighted values over the
    keys they all see (`Decoder.attend_rows`: each row's result is still the one it gets alone); on a
    sliding layer the rows with full windows run as one batch of same-shaped products
    (`Decoder.attend_windows`). So
    within `batch_limit` rows, every row is bitwise what stepping its tokens one at a time gives: a
    draft is verified in one step (`drafts.py`), and `Slot.rewind` drops the rows it rejects."""
    if len(slots) != len(tokens) or not slots:
        raise ValueError(f"one token list per slot: {len(tokens)} lists for {len(slots)} slots")
    if any(not t for t in tokens):
        raise ValueError("every slot needs at least one token")
    if any(s.room < len(t) for s, t in zip(slots, tokens, strict=True)):
        raise ValueError("a slot has no room left for its tokens")
    cfg = model.cfg
    flat = [t for ts in tokens for t in ts]
    b = len(flat)
    rows = max(b, MIN_ROWS)
    h = model.embed(torch.tensor(flat))
    if rows > b:  # padding: zero rows stay finite through every layer and are dropped at the end
        h = torch.cat((h, h.new_zeros(rows - b, h.shape[1])))
    spans = [(s, s.n, len(ts)) for s, ts in zip(slots, tokens, strict=True)]  # (slot, first position, rows)
    pos = torch.tensor([n + r for _, n, m in spans for r in range(m)] + [0] * (rows - b))
    pad = h.new_zeros(rows - b, cfg.num_heads * cfg.head_dim)
    plan = RowPlan(cfg, pos)  # RoPE's cos and sin once per step, not once per layer
    for i in range(cfg.num_layers):
        q, k, v = model.project(i, h, pos, plan, step=True)
        w = cfg.window(i)
        outs = []
        at = 0
        for s, n, m in spans:
            ki, vi = s.k[i], s.v[i]  # (kv_heads, T, head_dim)
            ki[:, n : n + m], vi[:, n : n + m] = k[:, at : at + m], v[:, at : at + m]
            ends = [n + r + 1 for r in range(m)]  # row r sits at position n + r and sees the keys up to it
            if w is None:
                outs.append(model.attend_rows(i, q[:, at : at + m], ki, vi, ends))
            else:  # within the window: the rows whose window is full in one call, the first ones each alone
                short = sum(e < w for e in ends)
                outs += [model.attend_all(i, q[:, at + r : at + r + 1], ki[:, :e], vi[:, :e])
                         for r, e in enumerate(ends[:short])]
                if short < m:
                    outs.append(model.attend_windows(i, q[:, at + short : at + m], ki, vi, ends[short:]))
            at += m
        h = model.finish(i, h, torch.cat(outs + [pad]), step=True)
    for s, _, m in spans:
        s.n += m
    return h[:b]


def batch_limit(model: Decoder, limit: int, screen: GreedyHead | None = None, probes: int = 2) -> int:
    """The largest b <= limit for which every row of a b-row step is bitwise equal to the same sequence
    stepped alone (in a MIN_ROWS step); 1 when even MIN_ROWS rows disagree. Checked with this model's
    own weights on `probes` sets of random caches and tokens (kernels are picked by shape, but a few
    element-wise ones round a vector body and a scalar tail differently, so more data is safer).

    `screen` (a `GreedyHead`) is checked too: its batched int8 screen must match its one-row screen."""
    best = max(1, limit)
    for seed in range(probes):
        if best < MIN_ROWS:
            break
        best = _probe(model, best, screen, seed)
    return best


def _probe(model: Decoder, limit: int, screen: GreedyHead | None, seed: int) -> int:
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    ctx = 7 + 5 * seed
    shape = (cfg.num_layers, cfg.num_kv_heads, ctx, cfg.head_dim)
    dtype, dev = model.compute_dtype, model.device

    def rand() -> torch.Tensor:  # drawn on the generator's device (the CPU), then moved to the model's
        return torch.randn(shape, generator=gen, device=gen.device).to(dev, dtype)

    caches = [KVCache(rand(), rand(), torch.arange(ctx, device=dev)) for _ in range(limit)]
    toks = torch.randint(0, cfg.vocab_size, (limit,), generator=gen, device=gen.device).tolist()

    def run(idx: list[int]) -> torch.Tensor:
        return step_hidden(model, [Slot(model, caches[j], 1) for j in idx], [toks[j] for j in idx])

    alone = [run([j])[0] for j in range(limit)]
    screens = [screen.screen(h[None])[0] for h in alone] if screen is not None else []
    best = 1
    for b in range(MIN_ROWS, limit + 1):
        h = run(list(range(b)))
        same = all(torch.equal(h[j], alone[j]) for j in range(b))
        if screen is not None and same:
            s = screen.screen(h)
            same = all(torch.equal(s[j], screens[j]) for j in range(b))
        if not same:
            break
        best = b
    return best


@dataclass(slots=True)
class Prefilled:
    fused: Fused
    counts: TokenCounts
    mode: str
    ratio: float | None
    writeback: list[Callable[[], object]] = field(default_factory=list)  # store writes to run after TTFT
    controller: Decision | None = None
    fuser: str = ""  # the fuser's spec, with its options


class TokenStream:
    """Iterates a request's generated token ids; `result` is set once iteration ends. `close()` cancels."""

    def __init__(self, run: Callable[[TokenStream], Generator[int, None, None]]) -> None:
        self.result: Generation | None = None
        self._gen = run(self)  # the generator records its Generation on this stream when it ends

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> int:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()


class Decoding:
    """One request from its first token to its last: `Engine.begin` makes it (and runs its store
    writes), `Engine.advance` adds a token, `close` returns its Generation.

    `tokens` are the tokens generated so far (a stop token ends it and is not kept); `done` is set
    by a stop token, at max_tokens, or by a failure (then `error` holds it)."""

    def __init__(
        self, pre: Prefilled, params: SamplingParams, stop: set[int], gen: torch.Generator | None, t0: float,
        ttft: float, store: StoreStats, record_logits: bool, constraint: TokenConstraint | None = None,
    ) -> None:
        self.pre, self.params, self.stop, self.gen, self.t0, self.ttft = pre, params, stop, gen, t0, ttft
        self.store = store
        self.tokens: list[int] = []
        self.done = False
        self.finish_reason = "length"
        self.slot: Slot | None = None
        # the logits that chose each token (a grammar's mask applied, as it was when the token was chosen)
        self.steps: list[torch.Tensor] | None = [masked(pre.fused.logits, constraint)] if record_logits else None
        self.scored: torch.Tensor | None = None
        self.result: Generation | None = None
        self.error: Exception | None = None
        self.context: Context | None = None  # the prompt and tokens so far, where drafts are proposed
        self.draft_len = DraftLength()
        self.drafts = DraftStats()
        # each token's log-probability, where asked (`SamplingParams.logprobs`): one per token chosen, in
        # order (a stop token's, not kept, is dropped at `close`)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.constraint = constraint  # a grammar over the tokens, where the request has one

    def take(self, tok: int) -> None:
        if tok in self.stop:
            self.done, self.finish_reason = True, "stop"
            return
        self.tokens.append(tok)
        if self.context is not None:
            self.context.extend((tok,))
        self.done = len(self.tokens) >= self.params.max_tokens
        if self.constraint is not None:
            self.constraint.advance(tok)
            if self.constraint.finished():  # the grammar's answer is complete
                self.done, self.finish_reason = True, "stop"

    def take_verified(self, chosen: Sequence[int], draft: Sequence[int]) -> int:
        """Take the tokens a draft's step chose (`chosen[r]` follows row r: the last token, then the draft)
        while they confirm the draft: the first, then one more for each draft token that equals the token
        chosen before it. Returns how many draft tokens were accepted; the slot's rows past them are
        rewound."""
        accepted = 0
        self.take(chosen[0])
        while accepted < len(draft) and not self.done and draft[accepted] == chosen[accepted]:
            accepted += 1
            self.take(chosen[accepted])
        if draft:
            self.drafts.steps += 1
            self.drafts.drafted += len(draft)
            self.drafts.accepted += accepted
            self.draft_len.update(len(draft), accepted)
            if self.slot is not None:
                self.slot.rewind(len(draft) - accepted)
        return accepted

    def fail(self, error: Exception) -> None:
        self.done, self.error = True, error

    def close(self) -> Generation:
        """Finish (early, if it is not done); returns the Generation, the same one on every call."""
        if self.result is None:
            self.done = True
            pre = self.pre
            self.result = Generation(
                self.tokens, self.ttft, time.perf_counter() - self.t0, pre.counts, pre.fused.lazy_logits(),
                self.finish_reason, pre.mode, pre.ratio, self.store, pre.controller,
                torch.stack(self.steps).float() if self.steps else None, self.scored, pre.fuser, self.drafts,
                self.logprobs[: len(self.tokens)] if self.logprobs is not None else None,
            )
        return self.result
