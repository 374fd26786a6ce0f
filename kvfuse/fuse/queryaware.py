"""Query-aware selection (ProphetKV-style, arXiv 2602.02579): let the question say which chunk tokens
matter, then recompute those on every layer.

Pass 1 is plain reuse: the prefix tail and the suffix are computed over the reused, re-rotated chunk
caches, and on every counted layer the suffix's attention over each chunk token is summed over heads and
suffix tokens. Pass 2 recomputes the top `ratio` of chunk tokens by that score on every layer, as one
fixed set (legolink's schedule with a chosen set), in pass 1's buffers: the chunk caches are read,
re-rotated and copied once, by pass 1.

Options (`queryaware@R:option=value`):
- `layers`: which layers' attention counts: "global" (the default: the full-attention layers of a
  sliding-window model, such as 3 of Gemma 3 270M's 18, where the question sees only the last 512
  tokens on the others; on a model without sliding layers, or with no full-attention layer, every
  layer) or "all".
- `wide`: gradual filtering on top of the question's choice. With wide > R, the first `FILTER_LAYERS`
  layers recompute the top `wide` share by attention, and the later ones keep the R of those whose KV
  deviates most there (blend's deviation measure); 0 (the default) is one fixed set.
- `behind`: what the chunk caches are computed behind (`registry.BEHIND`); by default "self", the chunk
  behind a copy of itself, which measured best among the order-free preambles.
- `weigh`: how a token's score adds up: "mass" sums the attention probabilities, so a head that looks
  mostly at the prefix or at itself adds little; "share" first normalises each head's and query's
  attention over the chunk tokens, so every head has one vote; "value" is "share" with each token's
  probability multiplied by the L1 norm of its value vector (then normalised again), so a token a head
  looks at but whose value adds little to its output counts less (VATP, arXiv 2406.12335). "auto" (the
  default) is "value" where every layer's attention counts (a model without sliding layers: many
  layers, each head's vote matters) and "mass" where only a few full-attention layers count (Gemma 3's
  3 of 18): what each model's calibration set measured best (docs/benchmarks.md; on SmolLM2 "value"
  edged out "share", which it replaced at stop 37).
- `cost`: what the ratio R budgets. "tokens" (the default) recomputes the top R of the chunk tokens by
  score. "work" makes R a share of the recompute work instead (`recompute_work`: a token's matmuls plus
  its attention over the keys before it, so a late token costs more than an early one) and takes tokens
  by score per unit of work until that share is spent.
- `ahead`: N > 0 drafts N tokens greedily on the reused cache (one more suffix pass each, in pass 1's
  buffers) and scores by the attention of the suffix and its draft: what the answer's first tokens
  look at, at the cost of N passes over the suffix.
- `skip`: pass 2 begins at layer N instead of 0. The picked tokens enter layer N with the residual
  stream their chunk's own precompute had there (kept with the chunk's cache, `kv.Residual`: one
  hidden vector per token, about 5% of a SmolLM2 chunk's KV), and the prefix tail and the suffix with
  pass 1's; below layer N every chunk token keeps its reused KV. That saves N layers of the picks'
  recompute. 0 (the default) recomputes from the first layer: skip=2 lowered SmolLM2's KL on its
  calibration set but not on the dev cases, and raised Gemma 3's (docs/benchmarks.md). At ratio 1.0
  every token is recomputed from layer 0 whatever `skip` says, so that 1.0 stays full prefill. A
  chunk cache without that residual makes the request recompute from layer 0.

Cost: the suffix twice, plus R of the chunk tokens on every layer (and wide - R more on the first
layers); at 0.15 about as much as blend@0.15's schedule.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfuse.config import ModelConfig
from kvfuse.fuse.core import IN_PLACE, FuseContext, Fused, FuseLayout, Resume, fuse_chunks
from kvfuse.fuse.registry import Fuser, Reads, check_behind, ratio_arg, register_fuser
from kvfuse.model import Decoder

DEFAULT_RATIO = 0.2  # the default fuser's ratio: at most 0.30x full's TTFT on Gemma 3 270M (docs/benchmarks.md)
FILTER_LAYERS = 2  # with `wide`, how many layers recompute the wide set before it narrows


def counted_layers(cfg: ModelConfig, layers: str) -> set[int]:
    """The layers whose attention counts: the full-attention ones for "global" (all, if none is)."""
    full = {i for i in range(cfg.num_layers) if cfg.window(i) is None}
    return full if layers == "global" and full else set(range(cfg.num_layers))


def settle_weigh(cfg: ModelConfig, layers: str, weigh: str) -> str:
    """weigh "auto" for this model: "value" when every layer counts, else "mass" (see the module docstring)."""
    if weigh != "auto":
        return weigh
    return "value" if len(counted_layers(cfg, layers)) == cfg.num_layers else "mass"


def suffix_attention(model: Decoder, layout: FuseLayout, layers: str = "global",
                     ctx: FuseContext = IN_PLACE, weigh: str = "auto", ahead: int = 0,
                     keep_hidden: int | None = None) -> tuple[torch.Tensor, Fused]:
    """(chunk tokens,) the suffix's attention over each chunk token, summed over the counted layers'
    heads and suffix queries, from a reuse pass; and that pass's result, whose buffers hold every
    chunk's re-rotated KV on every layer (with ctx.room + ahead tokens of room), and, with
    `keep_hidden`, the prefix tail's and suffix's input to that layer (`Fused.rows_hidden`).

    With `ahead`, that many tokens are first drafted greedily on the reused cache, each by one more pass
    over the suffix alone in the same buffers, and the attention counted is that of the suffix and its
    draft: what the answer's first tokens look at, not only the question."""
    cfg = model.cfg
    counted = counted_layers(cfg, layers)
    weigh = settle_weigh(cfg, layers, weigh)
    start = layout.chunks_begin
    n = start + layout.chunk_tokens
    score = torch.zeros(layout.chunk_tokens)

    def observe(i: int, q: torch.Tensor, q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                k_pos: torch.Tensor) -> None:
        mine = q_rows >= n  # the suffix's queries
        if i in counted and bool(mine.any()):
            # (heads, S, C); "share": normalised over the chunk tokens, so every head and query has one vote
            probs = model.attention_to(i, q[:, mine], q_rows[mine], keys, k_pos, start, n, weigh != "mass")
            if weigh == "value":  # each token's share of what the head reads: probability times |value|
                probs = value_weighted(probs, values[:, start:n], cfg.num_heads)
            score.add_(probs.sum(dim=(0, 1)))

    reuse = [0] * cfg.num_layers
    first_ctx = dataclasses.replace(ctx, observe=None if ahead else observe, room=ctx.room + ahead)
    first = fuse_chunks(model, layout, reuse, ctx=first_ctx, keep_hidden=keep_hidden)
    out, draft = first, []
    for j in range(ahead):  # the draft's passes read the placed chunks; only the last one is observed
        draft.append(int(out.logits.argmax()))
        longer = dataclasses.replace(layout, suffix=torch.cat((layout.suffix, torch.tensor(draft))))
        assert first.buffers is not None
        out = fuse_chunks(model, longer, reuse, resume=Resume(first.buffers),
                          ctx=FuseContext(pause=ctx.pause, observe=observe if j == ahead - 1 else None))
    return score, first


def value_weighted(probs: torch.Tensor, values: torch.Tensor, heads: int) -> torch.Tensor:
    """(heads, S, C) attention shares over the chunk tokens reweighted by the L1 norm of each token's value
    vector (VATP, arXiv 2406.12335: what a token adds to a head's output is its probability times its value)
    and normalised again, so every head and query still has one vote. `values` is (kv_heads, C, head_dim);
    the query heads that share a kv head share its norms."""
    norms = values.float().abs().sum(-1).repeat_interleave(heads // values.shape[0], 0)  # (heads, C)
    w = probs * norms[:, None, :]
    return w / w.sum(-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)


def recompute_work(cfg: ModelConfig, positions: torch.Tensor) -> torch.Tensor:
    """(T,) float64: the multiply-adds of recomputing tokens at these absolute positions on every layer:
    the layer's matmuls, the same for every token, plus the attention scores and weighted values over
    the keys the token sees (those before it, at most the window on a sliding layer)."""
    h, d = cfg.hidden_size, cfg.head_dim
    matmul = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * cfg.intermediate_size
    seen = positions.to(torch.float64) + 1
    work = torch.zeros_like(seen)
    for i in range(cfg.num_layers):
        window = cfg.window(i)
        work += matmul + 2 * cfg.num_heads * d * (seen if window is None else seen.clamp(max=window))
    return work


def pick(score: torch.Tensor, share: float, work: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted indices of the tokens to recompute: the top `share` of them by score, or, given each
    token's work, the best by score per unit of work until `share` of the total work is spent."""
    n = score.shape[0]
    if work is None:
        k = min(n, math.ceil(share * n - 1e-9))
        return torch.topk(score, k).indices.sort().values if k else torch.empty(0, dtype=torch.int64)
    order = torch.argsort(score.double() / work, descending=True, stable=True)
    spent = torch.cumsum(work[order], 0)
    return order[spent <= share * float(work.sum()) * (1 + 1e-9)].sort().values


def query_aware(model: Decoder, layout: FuseLayout, ratio: float = DEFAULT_RATIO, layers: str = "global",
                ctx: FuseContext = IN_PLACE, wide: float = 0.0, weigh: str = "auto", ahead: int = 0,
                cost: str = "tokens", skip: int = 0) -> Fused:
    """Recompute, on every layer (from layer `skip` on), the chunk tokens the question attends to most
    (see the module docstring)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be between 0 and 1, got {ratio}")
    if not 0 <= skip < model.cfg.num_layers:
        raise ValueError(f"skip must be a layer between 0 and {model.cfg.num_layers - 1}, got {skip}")
    n_c = layout.chunk_tokens
    skip = skip if ratio < 1.0 else 0  # at 1.0 everything is recomputed from its embedding: full prefill
    score, reused = suffix_attention(model, layout, layers, ctx, weigh, ahead, skip or None)
    start = layout.chunks_begin
    work = recompute_work(model.cfg, torch.arange(start, start + n_c)) if cost == "work" else None
    chosen = pick(score, max(ratio, wide), work)  # the set of the first layers (with wide <= ratio: the fixed set)
    first = chosen.shape[0]
    k = first if wide <= ratio else pick(score, ratio, work).shape[0]
    layers_n = model.cfg.num_layers
    keep = [first] * min(FILTER_LAYERS, layers_n) + [k] * max(0, layers_n - FILTER_LAYERS)  # first == k: fixed
    # pass 2 recomputes in pass 1's buffers: the prefix and the re-rotated chunk KV are in place already
    placed = reused.buffers if reused.buffers is not None else (reused.cache.k, reused.cache.v)
    begin, hidden = _resume(layout, chosen, reused, skip)
    return fuse_chunks(model, layout, keep, candidates=chosen, ctx=FuseContext(rotate=ctx.rotate, pause=ctx.pause),
                       resume=Resume(placed, begin, hidden))


def _resume(layout: FuseLayout, chosen: torch.Tensor, reused: Fused, skip: int) -> tuple[int, torch.Tensor | None]:
    """Where pass 2 begins and its rows' input there: at `skip`, the prefix tail and suffix as pass 1
    left them and the picked tokens as their chunks' residual streams; at 0 (their embeddings) when
    skip is 0 or a chunk's cache holds no residual at that layer."""
    if not skip or reused.rows_hidden is None:
        return 0, None
    streams = [c.residual_at(skip) for c in layout.chunks]
    if any(s is None for s in streams):
        return 0, None
    rows = reused.rows_hidden
    picked = torch.cat([s for s in streams if s is not None])[chosen].to(rows.dtype)
    tail = int(layout.prefix_tail.shape[0])
    return skip, torch.cat((rows[:tail], picked, rows[tail:]))


@register_fuser
@dataclass(frozen=True, slots=True)
class QueryAware:
    """`queryaware@R`: the question's attention picks R of the chunk tokens, recomputed on every layer."""

    name: ClassVar[str] = "queryaware"
    reads: ClassVar[Reads] = "chunks"
    exact: ClassVar[bool] = False
    takes_ratio: ClassVar[bool] = True
    default_ratio: ClassVar[float] = DEFAULT_RATIO
    layers: str = "global"  # "global": only the full-attention layers' attention counts; or "all"
    wide: float = 0.0  # > ratio: the first layers recompute this share, narrowed by deviation after
    behind: str = "self"  # chunks computed behind a copy of themselves (see registry.BEHIND)
    weigh: str = "auto"  # "mass": probabilities summed; "share": each head's normalised; "value": share x |v|;
    # "auto": by the model
    ahead: int = 0  # tokens drafted on the reused cache whose attention counts too
    cost: str = "tokens"  # what the ratio budgets: "tokens", or "work" (score per unit of recompute work)
    skip: int = 0  # the layer pass 2 begins at, from the chunks' residual streams (0: recompute from the first)

    def __post_init__(self) -> None:
        if self.layers not in ("all", "global"):
            raise ValueError(f"layers must be 'all' or 'global', got {self.layers!r}")
        if not 0.0 <= self.wide <= 1.0:
            raise ValueError(f"wide must be between 0 and 1, got {self.wide}")
        if self.weigh not in ("auto", "mass", "share", "value"):
            raise ValueError(f"weigh must be 'auto', 'mass', 'share' or 'value', got {self.weigh!r}")
        if self.cost not in ("tokens", "work"):
            raise ValueError(f"cost must be 'tokens' or 'work', got {self.cost!r}")
        if self.skip < 0:
            raise ValueError(f"skip must be a layer number (0: recompute from the first layer), got {self.skip}")
        check_behind(self.behind)

    def for_model(self, cfg: ModelConfig) -> QueryAware:
        """This fuser with weigh "auto" settled for the model (`registry.for_model`); a skip the model
        has no layer for is refused here."""
        if self.skip >= cfg.num_layers:
            raise ValueError(f"skip must be below the model's {cfg.num_layers} layers, got {self.skip}")
        return dataclasses.replace(self, weigh=settle_weigh(cfg, self.layers, self.weigh))

    @property
    def residual_layer(self) -> int | None:
        """The layer whose residual stream the chunk caches keep: `skip`, if above 0."""
        return self.skip or None

    def fuse(self, model: Decoder, layout: FuseLayout, ratio: float | None, ctx: FuseContext) -> Fused:
        r = self.default_ratio if ratio is None else ratio
        return query_aware(model, layout, r, self.layers, ctx, self.wide, self.weigh, self.ahead, self.cost,
                           self.skip)

    def label(self, ratio: float | str | None) -> str:
        return self.name if ratio is None else f"{self.name}@{ratio}"

    @classmethod
    def from_arg(cls, arg: str | None) -> tuple[Fuser, float | str | None]:
        return cls(), ratio_arg(cls.name, arg)
