"""The layer loop every fuser runs: a request's KV cache built in one layer-by-layer pass.

A request's prompt is  prefix | prefix_tail | chunk_1 | ... | chunk_n | suffix  (a `FuseLayout`). Every
builder returns a `Fused`: the KV cache of the whole prompt at positions 0..T-1 and the hidden state of
its last token, whose logits (`Fused.logits`) are computed on first use: a greedy request's first token
needs only their argmax, which the engine finds through the int8 screen of the LM head (`lmhead.py`)
without reading the float head, and the first pass of a two-pass fuser needs no logits at all.

- `prefill` is the naive path, and the oracle every other path is tested against.
- `fuse_chunks` places precomputed chunk caches after the exact prefix, re-rotating their keys to the
  new positions, computes the prefix tail and the suffix on every layer, and on layer l recomputes the
  keep[l] chunk tokens that score highest (by default, by KV deviation) among the previous layer's.
  The fusers in this package (reuse, blend, legolink) are choices of `keep`, the candidate set and
  the score.

Recomputed tokens attend to every earlier key, reused or fresh, under the exact per-position causal
mask (and the sliding window of the layer), never a bottom-right-aligned approximation.

On the last layer every builder computes the keys and values of all its rows but the attention and MLP
of the prompt's last token only: nothing else reads the other rows' outputs (about 5% of a prefill).

Every builder takes a `pause`: a callable it calls between pieces of work (after each layer, and in a
prefill after each PREFILL_SLICE-token slice of a layer), where its caller may run something else (the
server steps the running requests there, so a long prefill never stalls their streams). Pausing
changes nothing computed. A prefill is always computed in the same slices, paused or not: its rows
are split on each layer into slices of PREFILL_SLICE tokens, each attending to every key before its
end, so a prompt of at most PREFILL_SLICE tokens is computed as one piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvfuse.config import ModelConfig, RopeSpec
from kvfuse.fuse.buffers import POOL, Lease
from kvfuse.kv import KVCache, Residual, one_thread
from kvfuse.loader import LayerKV, LayerLoader, LayerSource
from kvfuse.model import Decoder, RowPlan, RowPlans
from kvfuse.rope import rerotate_into

# (out, k, from_pos, to_pos, head_dim, spec): write keys k moved from from_pos to to_pos into out
Rerotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, RopeSpec], None]
# (k_new, v_new, k_old, v_old) -> per-token deviation (T,); swap it for ablations (random choice, say)
Deviation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (layer, q, q_rows, keys, values, key_positions): sees each layer's queries, at their positions, and all its
# keys and values (kv_heads, total, head_dim) once they are in place; query-aware selection reads the suffix's
# attention here
Observe = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# called between pieces of a build (see the module docstring); it must not touch the build's tensors
Pause = Callable[[], None]
PREFILL_SLICE = 512  # prefill rows per piece of a layer: short enough to pause often, long enough to stay fast


def no_pause() -> None:
    pass


@dataclass(slots=True)
class Fused:
    cache: KVCache  # the whole prompt, positions 0..T-1
    hidden: torch.Tensor  # (hidden,) the last prompt token's output, before the final norm
    head: Callable[[torch.Tensor], torch.Tensor]  # (rows, hidden) -> (rows, vocab) logits: `Decoder.logits`
    recomputed_token_layers: int = 0  # sum over layers of reused tokens that were recomputed
    selected: list[torch.Tensor] = field(default_factory=list)  # blend: chunk-token indices per layer
    # the buffers `cache` views, `room` tokens longer: decoding appends to them in place, with no copy
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    # with `fuse_chunks(keep_hidden=L)`: (rows, hidden) the input of layer L of the rows computed there
    rows_hidden: torch.Tensor | None = None
    _logits: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)  # `logits`, once computed

    @property
    def logits(self) -> torch.Tensor:
        """(vocab,) float32 next-token logits after the last prompt token, computed on first use."""
        return _memo_logits(self.head, self.hidden, self._logits)

    def lazy_logits(self) -> Callable[[], torch.Tensor]:
        """A callable that returns `logits` (computed at most once) and holds only the hidden state, not
        the cache: what a finished Generation keeps."""
        head, hidden, memo = self.head, self.hidden, self._logits
        return lambda: _memo_logits(head, hidden, memo)


def _memo_logits(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, memo: list[torch.Tensor]
                 ) -> torch.Tensor:
    if not memo:
        with torch.inference_mode():  # asked for after the prefill, perhaps outside the engine's inference mode
            memo.append(head(hidden[None])[0])
    return memo[0]


def _buffers(model: Decoder, total: int, room: int = 0, parts: Sequence[KVCache] = ()) -> Lease:
    """The model's K and V buffers (layers, kv_heads, total + room, head_dim) in its compute dtype, from
    the pool (`buffers.py`), holding the first `lease.done` of `parts` already."""
    if room < 0:
        raise ValueError(f"room must be >= 0, got {room}")
    cfg = model.cfg
    shape = (cfg.num_layers, cfg.num_kv_heads, total + room, cfg.head_dim)
    return POOL.take(shape, model.compute_dtype, model.device, parts)


def _fused(model: Decoder, k_buf: torch.Tensor, v_buf: torch.Tensor, total: int, h: torch.Tensor, room: int,
           recomputed: int = 0, selected: list[torch.Tensor] | None = None,
           rows_hidden: torch.Tensor | None = None) -> Fused:
    """The first `total` tokens of the buffers as the prompt's cache, and h (1, hidden) the last token's
    output; with room, the buffers ride along."""
    cache = KVCache(k_buf[:, :, :total], v_buf[:, :, :total], torch.arange(total))
    return Fused(cache, h[-1], model.logits, recomputed, selected or [], (k_buf, v_buf) if room else None,
                 rows_hidden)


def _run(model: Decoder, ids: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, start: int,
         pause: Pause = no_pause) -> torch.Tensor:
    """Prefill ids at positions start.. into the buffers after the keys already in [0, start); returns the
    last token's hidden state. Each layer runs in slices of PREFILL_SLICE rows, pausing after each."""
    n = ids.shape[0]
    end = start + n
    pos_all = torch.arange(end)
    slices = [(s, min(s + PREFILL_SLICE, n)) for s in range(0, n, PREFILL_SLICE)]
    h = model.embed(ids)
    last = model.cfg.num_layers - 1
    plans = [RowPlan(model.cfg, pos_all[start + s : start + e], pos_all[: start + e]) for s, e in slices]
    for i in range(last):
        outs = []
        for (s, e), plan in zip(slices, plans, strict=True):
            pos = plan.q_pos
            q, k, v = model.project(i, h[s:e], pos, plan)
            k_buf[i, :, start + s : start + e], v_buf[i, :, start + s : start + e] = k, v
            a = model.attend(i, q, pos, k_buf[i, :, : start + e], v_buf[i, :, : start + e], plan.k_pos, plan)
            outs.append(model.finish(i, h[s:e], a))
            pause()
        h = torch.cat(outs) if len(outs) > 1 else outs[0]
    for (s, e), plan in zip(slices, plans, strict=True):  # the last layer: every token needs just its KV
        k_buf[last, :, start + s : start + e], v_buf[last, :, start + s : start + e] = model.key_value(
            last, h[s:e], plan.q_pos, plan)
        pause()
    q = model.query(last, h[-1:], pos_all[-1:])
    a = model.attend(last, q, pos_all[-1:], k_buf[last, :, :end], v_buf[last, :, :end], pos_all)
    return model.finish(last, h[-1:], a)


def prefill(
    model: Decoder, ids: torch.Tensor, past: KVCache | Sequence[KVCache] | None = None, room: int = 0,
    pause: Pause = no_pause,
) -> Fused:
    """Full prefill of ids after an optional exact past cache (positions 0..len(past)-1).

    `past` may be given in pieces (prefix blocks, say); they are copied straight into the new buffer.
    `room` reserves that many more token slots for decoding (see `Fused.buffers`)."""
    if ids.numel() == 0:
        raise ValueError("prefill needs at least one new token")
    parts = [past] if isinstance(past, KVCache) else list(past or [])
    start = sum(len(c) for c in parts)
    end = start + ids.shape[0]
    bufs = _buffers(model, end, room, parts)
    _copy_in(parts, bufs)
    h = _run(model, ids, bufs.k, bufs.v, start, pause)
    return _fused(model, bufs.k, bufs.v, end, h, room)


def _copy_in(parts: Sequence[KVCache], bufs: Lease) -> None:
    """Copy the parts into the buffers one after another, but for the first `bufs.done`, already there."""
    at = sum(len(c) for c in parts[: bufs.done])
    with one_thread():  # many small copies (prefix blocks): see kv.one_thread
        for c in parts[bufs.done :]:
            bufs.k[:, :, at : at + len(c)], bufs.v[:, :, at : at + len(c)] = c.k, c.v
            at += len(c)
    bufs.holds(parts)


def precompute_chunk(
    model: Decoder, preamble: Sequence[int], chunk: Sequence[int], start: int | None = None,
    pause: Pause = no_pause, residual: int | None = None,
) -> KVCache:
    """KV of a chunk computed on its own behind the preamble; only the chunk's tokens are kept.

    The preamble sits at positions 0..len(preamble)-1 and the chunk at start.. (default: right after it).
    With `residual` (a layer, 0 < residual < layers), the cache also keeps the chunk tokens' input to
    that layer (`KVCache.residual`).
    """
    if residual is not None and not 0 < residual < model.cfg.num_layers:
        raise ValueError(f"residual must be a layer between 1 and {model.cfg.num_layers - 1}, got {residual}")
    pre = torch.tensor(list(preamble), dtype=torch.int64)
    ids = torch.tensor(list(chunk), dtype=torch.int64)
    if ids.numel() == 0:
        raise ValueError("a chunk needs at least one token")
    start = len(pre) if start is None else start
    if start < len(pre):
        raise ValueError("a chunk cannot start inside its preamble")
    pos = torch.cat((torch.arange(len(pre)), torch.arange(start, start + len(ids))))
    bufs = _buffers(model, len(pos))
    k_buf, v_buf = bufs.k, bufs.v
    h = model.embed(torch.cat((pre, ids)))
    last = model.cfg.num_layers - 1
    plan = RowPlan(model.cfg, pos)
    n = len(pre)
    kept: Residual | None = None
    for i in range(last):
        if i == residual:
            kept = Residual(i, h[n:].clone())
        q, k, v = model.project(i, h, pos, plan)
        k_buf[i], v_buf[i] = k, v
        h = model.finish(i, h, model.attend(i, q, pos, k, v, pos, plan))
        pause()
    if last == residual:
        kept = Residual(last, h[n:].clone())
    k_buf[last], v_buf[last] = model.key_value(last, h, pos, plan)  # the cache needs no output from the last layer
    return KVCache(k_buf[:, :, n:].clone(), v_buf[:, :, n:].clone(), pos[n:].clone(), kept)


def _place_layer(
    cfg: ModelConfig,
    layer: int,
    chunks: Sequence[LayerSource],
    layer_kv: LayerKV,
    start: int,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    rotate: Rerotate = rerotate_into,
) -> None:
    """Write one layer's K/V of each chunk (keys re-rotated) back to back from position start."""
    at = start
    for c, (k, v) in zip(chunks, layer_kv, strict=True):
        n = len(c)
        rotate(k_out[:, at : at + n], k, c.positions, torch.arange(at, at + n), cfg.head_dim, cfg.rope(layer))
        v_out[:, at : at + n].copy_(v)
        at += n


def kv_deviation(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor:
    """Per-token KV deviation (T,) between fresh and reused K/V of shape (kv_heads, T, head_dim)."""
    def part(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        err = (new.float() - old.float()).pow(2).sum(dim=(0, 2))
        scale = old.float().pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-12)
        return err / scale

    return part(k_new, k_old) + part(v_new, v_old)


@dataclass(frozen=True, slots=True)
class FuseLayout:
    """A request laid out for fusion:  prefix | prefix_tail | chunks | suffix.

    prefix       an exact cache of the first tokens, possibly in pieces (stored prefix blocks)
    prefix_tail  (P,) ids of the prefix's uncached end, computed on every layer
    chunks       precomputed chunk caches, read one layer at a time
    chunk_ids    (n_i,) ids of each chunk (needed only by fusers that recompute chunk tokens)
    suffix       (S,) ids of the question, computed on every layer"""

    prefix: tuple[KVCache, ...]
    prefix_tail: torch.Tensor
    chunks: tuple[LayerSource, ...]
    chunk_ids: tuple[torch.Tensor, ...]
    suffix: torch.Tensor

    @classmethod
    def of(cls, prefix: KVCache | Sequence[KVCache] | None, chunks: Sequence[LayerSource], suffix: torch.Tensor,
           chunk_ids: Sequence[torch.Tensor] = (), prefix_tail: torch.Tensor | None = None) -> FuseLayout:
        parts = (prefix,) if isinstance(prefix, KVCache) else tuple(prefix or ())
        tail = prefix_tail if prefix_tail is not None else torch.empty(0, dtype=torch.int64)
        return cls(parts, tail, tuple(chunks), tuple(chunk_ids), suffix)

    @property
    def chunk_tokens(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def chunks_begin(self) -> int:
        """The absolute position of the first chunk token: after the prefix and its tail."""
        return sum(len(c) for c in self.prefix) + int(self.prefix_tail.shape[0])

    def chunk_starts(self) -> list[int]:
        """Where each chunk starts among the chunk tokens."""
        out, at = [], 0
        for c in self.chunks:
            out.append(at)
            at += len(c)
        return out


@dataclass(frozen=True, slots=True)
class FuseContext:
    """How a pass runs, the same for every fuser, none of which changes what it computes: the key mover,
    the layer loader (default: read in place, nothing ahead), decode room, what to call after each layer
    (`Pause`: the server steps running requests there) and what sees each layer's queries and keys
    (`Observe`: query-aware selection reads the suffix's attention there)."""

    rotate: Rerotate = rerotate_into
    loader: LayerLoader | None = None
    room: int = 0
    pause: Pause = no_pause
    observe: Observe | None = None


IN_PLACE = FuseContext()  # the default: rotate in place, read chunk layers as they are, no decode room


@dataclass(frozen=True, slots=True)
class Resume:
    """A pass over an earlier pass's buffers (`Fused.buffers`, or its cache's tensors, at least the
    layout's length): they hold the prefix and every chunk's re-rotated KV on every layer already, so
    nothing is copied in or read again, only the rows the pass computes are overwritten, and the room
    is what the buffers have beyond the layout. With `begin` > 0 the pass starts at that layer (the
    earlier ones stay as placed) from `hidden`, the rows' input there (the prefix tail, the candidates,
    the suffix, in order), where it would otherwise be their embeddings."""

    placed: tuple[torch.Tensor, torch.Tensor]
    begin: int = 0
    hidden: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.begin < 0 or (self.begin > 0) != (self.hidden is not None):
            raise ValueError(f"a pass that begins at layer {self.begin} needs the rows' hidden input there "
                             "(and one that begins at layer 0 takes none)")


def fuse_chunks(model: Decoder, layout: FuseLayout, keep: Sequence[int], *, candidates: torch.Tensor | None = None,
                deviation: Deviation | None = None, ctx: FuseContext = IN_PLACE, resume: Resume | None = None,
                keep_hidden: int | None = None) -> Fused:
    """Compute the layout in one layer-by-layer pass, recomputing keep[l] chunk tokens on layer l.

    The prefix is an exact cache; the prefix tail and the suffix are computed on every layer; on layer
    l the keep[l] chunk tokens of highest deviation among the previous layer's are recomputed (keep all
    zero is plain reuse, and needs no chunk ids). `candidates` (sorted chunk-token indices) replaces
    "every chunk token" as layer 0's set; `deviation` replaces `kv_deviation` as the score the kept
    tokens are ranked by; `ctx` is how the pass runs; `resume` makes it a pass over an earlier pass's
    buffers; `keep_hidden` returns the rows' input to that layer as `Fused.rows_hidden`."""
    pass_ = _Pass.start(model, layout, keep, candidates, ctx, resume)
    score = deviation if deviation is not None else kv_deviation
    rows_hidden: torch.Tensor | None = None
    own_loader = ctx.loader is None and resume is None
    loader = LayerLoader(layout.chunks, model.cfg.num_layers, pipelined=False) if own_loader else ctx.loader
    try:
        for i in range(resume.begin if resume else 0, model.cfg.num_layers):
            if i == keep_hidden:
                rows_hidden = pass_.h.clone()
            if resume is None:  # this pass reads the chunk layers itself
                assert loader is not None
                pass_.place(i, loader.synchronize(i), ctx.rotate, keep[i])  # the next layer is on its way
            pass_.layer(i, keep[i], score, ctx.observe)
            ctx.pause()
    finally:
        if own_loader and loader is not None:
            loader.close()
    return _fused(model, pass_.k_buf, pass_.v_buf, pass_.total, pass_.h, pass_.room, pass_.recomputed,
                  pass_.selected, rows_hidden)


@dataclass(slots=True)
class _Pass:
    """One pass's state: its buffers, its rows (the prefix tail, the candidate chunk tokens as indices
    into the chunk span, the suffix) and their hidden states, and what it recomputed so far."""

    model: Decoder
    layout: FuseLayout
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    room: int
    cand: torch.Tensor
    h: torch.Tensor
    plans: RowPlans
    selected: list[torch.Tensor] = field(default_factory=list)
    recomputed: int = 0

    @property
    def total(self) -> int:
        return self.layout.chunks_begin + self.layout.chunk_tokens + int(self.layout.suffix.shape[0])

    @classmethod
    def start(cls, model: Decoder, layout: FuseLayout, keep: Sequence[int], candidates: torch.Tensor | None,
              ctx: FuseContext, resume: Resume | None) -> _Pass:
        """The pass's buffers (new, with the prefix copied in, or the resumed pass's), its first
        candidates, and its rows' input: their embeddings, or the resumed pass's hidden."""
        cfg, n_c = model.cfg, layout.chunk_tokens
        if layout.suffix.numel() == 0:
            raise ValueError("fusing chunks needs a non-empty suffix")
        lengths = [len(c) for c in layout.chunks]
        if (keep[0] or candidates is not None) and lengths != [len(t) for t in layout.chunk_ids]:
            raise ValueError("every chunk cache needs its token ids, of the same length")
        total = layout.chunks_begin + n_c + int(layout.suffix.shape[0])
        if resume is None:
            bufs = _buffers(model, total, ctx.room, layout.prefix)
            _copy_in(layout.prefix, bufs)
            k_buf, v_buf = bufs.k, bufs.v
        else:
            k_buf, v_buf = resume.placed
            if k_buf.shape[2] < total or k_buf.shape[0] != cfg.num_layers:
                raise ValueError(f"placed buffers of shape {tuple(k_buf.shape)} cannot hold this layout "
                                 f"({total} tokens)")
            if resume.begin >= cfg.num_layers:
                raise ValueError(f"a pass cannot begin at layer {resume.begin} of {cfg.num_layers}")
        cand = candidates.to(torch.int64) if candidates is not None else (
            torch.arange(n_c) if keep[0] else torch.empty(0, dtype=torch.int64))
        if keep[0] > cand.shape[0]:
            raise ValueError(f"layer 0 keeps {keep[0]} tokens but there are only {cand.shape[0]} candidates")
        tail, suffix = layout.prefix_tail, layout.suffix
        cand_ids = torch.cat(list(layout.chunk_ids))[cand] if cand.numel() else torch.empty(0, dtype=torch.int64)
        h = model.embed(torch.cat([tail, cand_ids, suffix])) if resume is None or resume.hidden is None \
            else resume.hidden
        if h.shape[0] != tail.shape[0] + cand.shape[0] + suffix.shape[0]:
            raise ValueError(f"hidden has {h.shape[0]} rows, but the pass computes {tail.shape[0] + cand.shape[0]} + "
                             f"{suffix.shape[0]}")
        return cls(model, layout, k_buf, v_buf, k_buf.shape[2] - total, cand, h, RowPlans(cfg))

    def place(self, i: int, layer_kv: LayerKV, rotate: Rerotate, keep: int) -> None:
        """Layer i's chunk KV, re-rotated into the buffers, where some of it is read on this layer (not
        every chunk token is a candidate, or not every candidate is kept)."""
        nc = self.cand.shape[0]
        if nc < self.layout.chunk_tokens or keep < nc:
            _place_layer(self.model.cfg, i, self.layout.chunks, layer_kv, self.layout.chunks_begin, self.k_buf[i],
                         self.v_buf[i], rotate)

    def layer(self, i: int, keep: int, score: Deviation, observe: Observe | None) -> None:
        """Layer i: the rows' keys (to rank the candidates, keeping the top `keep`), then the attention
        and MLP of the rows kept (of the last row alone on the last layer: only its output is read)."""
        model, start, total = self.model, self.layout.chunks_begin, self.total
        p = sum(len(c) for c in self.layout.prefix)
        fixed_lo, fixed_hi = torch.arange(p, start), torch.arange(start + self.layout.chunk_tokens, total)
        n_lo, nc, h, cand = fixed_lo.shape[0], self.cand.shape[0], self.h, self.cand
        pos_all = torch.arange(total)
        rows = torch.cat((fixed_lo, cand + start, fixed_hi))  # absolute positions of the rows of h
        last = i == model.cfg.num_layers - 1
        top, q_rows = torch.arange(nc), rows
        plan = self.plans.get(rows, pos_all)
        k_buf, v_buf = self.k_buf[i], self.v_buf[i]
        if keep < nc or last:  # keys first: to rank the candidates, or as all the other rows need
            k, v = model.key_value(i, h, rows, plan)
            if keep < nc:  # measure the candidates' deviation, keep the top `keep`
                span = slice(n_lo, n_lo + nc)
                dev = score(k[:, span], v[:, span], k_buf[:, cand + start], v_buf[:, cand + start])
                top = torch.topk(dev, keep).indices.sort().values
                sel = torch.cat((torch.arange(n_lo), top + n_lo, torch.arange(n_lo + nc, rows.shape[0])))
                h, q_rows = h[sel], rows[sel]
            if last:
                h, q_rows = h[-1:], q_rows[-1:]
            plan = self.plans.get(q_rows, pos_all)
            q = model.query(i, h, q_rows, plan)
        else:
            q, k, v = model.project(i, h, rows, plan)
        k_buf[:, rows], v_buf[:, rows] = k, v  # fresh KV for every row, dropped candidates too
        if observe is not None:
            observe(i, q, q_rows, k_buf[:, :total], v_buf[:, :total], pos_all)
        a = model.attend(i, q, q_rows, k_buf[:, :total], v_buf[:, :total], pos_all, plan)
        self.h = model.finish(i, h, a)
        self.cand = cand[top]
        self.selected.append(self.cand)
        self.recomputed += int(self.cand.shape[0])
