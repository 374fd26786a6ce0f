"""Incremental decoding: one new token per sequence per step, several sequences in one step, and a
request's decoding state (`Decoding`, from its first token to its `Generation`).

Each sequence keeps its own cache (`Slot`). A step (`step_hidden`) runs the layers' projections and
MLPs for every sequence's new token as one matrix, so the weights are read once for the whole batch;
on a CPU decoding is memory-bound, and four sequences step in well under twice the time of one. Each
sequence's attention runs over its own cache.

Batching must not change answers: a request must decode to the same tokens alone or beside others.
A row of a float32 matrix product depends only on its own input row, but the order of its sums
depends on the kernel, which the BLAS picks by shape: on x86, one row takes a matrix-vector path that
sums differently from the 2-to-8-row products. So a step always runs at least MIN_ROWS rows (a lone
sequence gets a zero row beside it), and `batch_limit` checks on the model and machine at hand up to
how many rows every row's result is bitwise the same as in a MIN_ROWS step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from kvfuse.control.policy import Decision
from kvfuse.fuse import Fused
from kvfuse.kv import KVCache
from kvfuse.lmhead import GreedyHead
from kvfuse.model import Decoder, RowPlan
from kvfuse.request import Generation, TokenCounts
from kvfuse.sampling import SamplingParams
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


def step_hidden(model: Decoder, slots: list[Slot], tokens: list[int]) -> torch.Tensor:
    """Feed tokens[j] to slots[j] at its next position; returns the last hidden states (len(slots), hidden),
    before the final norm. Every slot needs room for one more token."""
    if len(slots) != len(tokens) or not slots:
        raise ValueError(f"one token per slot: {len(tokens)} tokens for {len(slots)} slots")
    if any(s.room < 1 for s in slots):
        raise ValueError("a slot has no room left for another token")
    cfg, b = model.cfg, len(slots)
    rows = max(b, MIN_ROWS)
    h = model.embed(torch.tensor(tokens))
    if rows > b:  # padding: zero rows stay finite through every layer and are dropped at the end
        h = torch.cat((h, h.new_zeros(rows - b, h.shape[1])))
    ns = [s.n for s in slots]
    pos = torch.tensor(ns + [0] * (rows - b))
    pad = h.new_zeros(rows - b, cfg.num_heads * cfg.head_dim)
    plan = RowPlan(cfg, pos)  # RoPE's cos and sin once per step, not once per layer
    for i in range(cfg.num_layers):
        q, k, v = model.project(i, h, pos, plan)
        w = cfg.window(i)
        outs = []
        for j, (s, n) in enumerate(zip(slots, ns, strict=True)):
            s.k[i, :, n : n + 1], s.v[i, :, n : n + 1] = k[:, j : j + 1], v[:, j : j + 1]
            lo = max(0, n + 1 - w) if w is not None else 0
            outs.append(model.attend_all(i, q[:, j : j + 1], s.k[i, :, lo : n + 1], s.v[i, :, lo : n + 1]))
        h = model.finish(i, h, torch.cat(outs + [pad]))
    for s in slots:
        s.n += 1
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
        ttft: float, store: StoreStats, record_logits: bool,
    ) -> None:
        self.pre, self.params, self.stop, self.gen, self.t0, self.ttft = pre, params, stop, gen, t0, ttft
        self.store = store
        self.tokens: list[int] = []
        self.done = False
        self.finish_reason = "length"
        self.slot: Slot | None = None
        self.steps: list[torch.Tensor] | None = [pre.fused.logits] if record_logits else None
        self.scored: torch.Tensor | None = None
        self.result: Generation | None = None
        self.error: Exception | None = None

    def take(self, tok: int) -> None:
        if tok in self.stop:
            self.done, self.finish_reason = True, "stop"
            return
        self.tokens.append(tok)
        self.done = len(self.tokens) >= self.params.max_tokens

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
                torch.stack(self.steps).float() if self.steps else None, self.scored, pre.fuser,
            )
        return self.result
