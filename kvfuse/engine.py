"""The engine: build a request's KV cache in one of four modes, then decode. Token ids only.

A request is  prefix | chunks | suffix:
- the prefix is cacheable as a prefix: its full blocks are stored under chained block hashes;
- each chunk is cacheable on its own, computed behind a fixed preamble (BOS) that is part of its key;
- the suffix (the question) is never cached.

Modes:  full    prefill everything (the oracle);
        prefix  reuse the longest cached prefix of prefix+chunks and prefill the rest (equals full);
        reuse   exact prefix, re-rotated chunk caches as they are, prefill the suffix;
        blend   reuse, then CacheBlend's selective recompute (see fuse.py);
        legolink  reuse, recomputing the first `head_tokens` of every chunk on every layer (EPIC's
                baseline: a fixed choice, no deviation).

TTFT is measured here, from the moment a request enters `stream` to the moment its first token is
chosen; it covers cache lookups, loads, any chunk computed on a miss, fusion and sampling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvfuse import fuse
from kvfuse.controller import Controller, Decision
from kvfuse.decode import Slot, batch_limit, step_hidden
from kvfuse.kv import KVCache, one_thread
from kvfuse.lmhead import GreedyHead
from kvfuse.loader import LayerKV, LayerLoader, LayerSource
from kvfuse.model import Decoder
from kvfuse.rope import rerotate_into
from kvfuse.sampling import MIN_TEMPERATURE, SamplingParams, sample
from kvfuse.store.disk import CorruptEntryError
from kvfuse.store.keys import BlockHash, ChunkKey, Salt, chunk_key, prefix_block_hashes, root_hash
from kvfuse.store.tiered import StoreStats, TieredStore

log = logging.getLogger(__name__)

MODES = ("full", "prefix", "reuse", "blend", "legolink")
LEGOLINK_HEAD_TOKENS = 16
Ratio = float | str | None  # a number in [0, 1], "auto" (the controller decides) or None (the default)


def parse_ratio(text: str) -> float | str:
    """A ratio as users write it: a number between 0 and 1, or 'auto'; ValueError says what is wrong."""
    if text == "auto":
        return text
    try:
        r = float(text)
    except ValueError:
        raise ValueError(f"the ratio must be a number between 0 and 1 or 'auto', got {text!r}") from None
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"the ratio must be between 0 and 1, got {text}")
    return r
BLOCK_SIZE = 16
MAX_DECODE_BATCH = 8  # the most requests one decoding step may carry (fewer if the check says so)
SELF_CHECK_TOLERANCE = 1e-3  # max |logit difference| relative to max |logit|


class RequestError(ValueError):
    """The request cannot be run as given; the message says what to change."""


class ModeUnavailableError(RuntimeError):
    """This model failed the load-time self-check, so chunk reuse (reuse, blend) is refused."""


@dataclass(frozen=True, slots=True)
class Request:
    suffix: tuple[int, ...]
    prefix: tuple[int, ...] = ()
    chunks: tuple[tuple[int, ...], ...] = ()
    salts: tuple[Salt, ...] = ()  # extra keys for the prefix blocks over given token ranges (tenants, groups)
    chunk_salt: str = ""  # an extra key for every chunk cache of this request (a tenant's own documents)

    @property
    def ids(self) -> list[int]:
        out = list(self.prefix)
        for c in self.chunks:
            out.extend(c)
        return out + list(self.suffix)

    def __len__(self) -> int:
        return len(self.prefix) + sum(len(c) for c in self.chunks) + len(self.suffix)


@dataclass(slots=True)
class TokenCounts:
    """prompt = prefilled + reused. recomputed counts reused tokens recomputed, in full-layer equivalents.

    cached counts the tokens whose KV was read from the store and used as read: reused tokens of
    prefix blocks and chunk caches that were hits, less their recomputed share (a chunk computed on
    a miss during this request is reused, but not cached)."""

    prompt: int = 0
    prefilled: int = 0
    reused: int = 0
    recomputed: int = 0
    cached: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class Prefilled:
    fused: fuse.Fused
    counts: TokenCounts
    mode: str
    ratio: float | None
    writeback: list[Callable[[], object]] = field(default_factory=list)  # store writes to run after TTFT
    controller: Decision | None = None


@dataclass(slots=True)
class Generation:
    tokens: list[int]
    ttft_s: float
    total_s: float
    counts: TokenCounts
    first_logits: torch.Tensor  # (vocab,) float32
    finish_reason: str  # "stop" (EOS or stop id) or "length"
    mode: str
    ratio: float | None
    store: StoreStats = field(default_factory=StoreStats)  # this request's lookups
    controller: Decision | None = None  # blend's ratio and tier decision, when a controller is set
    step_logits: torch.Tensor | None = None  # (steps, vocab) logits that chose each token, if recorded
    scored_logits: torch.Tensor | None = None  # (len(score), vocab) teacher-forced logits, if asked

    def first_token_top(self, k: int = 20) -> list[tuple[int, float]]:
        """The k most likely first tokens as (token_id, logprob)."""
        lp = torch.log_softmax(self.first_logits.float(), -1)
        top = torch.topk(lp, k)
        return [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=False)]


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


class Engine:
    def __init__(
        self,
        model: Decoder,
        fingerprint: str,
        store: TieredStore | None = None,
        preamble: Sequence[int] | None = None,
        block_size: int = BLOCK_SIZE,
        kv_dtype: torch.dtype = torch.float32,
        self_check: bool = True,
        rotate: fuse.Rerotate = rerotate_into,
        greedy_screen: bool = True,
    ) -> None:
        self.model, self.cfg, self.fingerprint = model, model.cfg, fingerprint
        self.store = store if store is not None else TieredStore()
        bos = self.cfg.bos_token_id
        default_preamble = (bos,) if bos is not None else ()
        self.preamble: tuple[int, ...] = tuple(preamble) if preamble is not None else default_preamble
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.pipelined = True  # read disk-backed chunk layers ahead of the recompute
        self.controller: Controller | None = None  # set one to enable ratio "auto" and decisions
        self._rotate = rotate
        self.greedy_screen = greedy_screen  # greedy steps screen the LM head in int8 (see lmhead.py)
        self._greedy_head: GreedyHead | None | bool = False  # False: not built yet
        self._batch_limit: int | None = None  # decode_batch_limit's checked answer
        self.blend_error: str | None = self.self_check() if self_check else None
        if self.blend_error:
            log.warning("%s", self.blend_error)

    @classmethod
    def load(
        cls, path: str | Path | None = None, store_dir: str | Path | None = None, **kwargs: object
    ) -> Engine:
        """Load a checkpoint (default: Gemma 3 270M), open its store (memory, plus disk at store_dir)
        and run the self-check."""
        from kvfuse.store import open_store
        from kvfuse.weights import load_model

        loaded = load_model(path)
        store = open_store(store_dir, loaded.fingerprint)
        return cls(loaded.model, loaded.fingerprint, store=store, **kwargs)  # type: ignore[arg-type]

    # -- checks ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def self_check(self) -> str | None:
        """Blend at ratio 1.0 must reproduce full prefill on a short probe; returns an error or None."""
        g = torch.Generator().manual_seed(0)
        vocab = self.cfg.vocab_size
        rand = lambda n: tuple(int(x) for x in torch.randint(min(4, vocab - 1), vocab, (n,), generator=g))  # noqa: E731
        req = Request(prefix=self.preamble + rand(3), chunks=(rand(9), rand(12), rand(7)), suffix=rand(4))
        full = fuse.prefill(self.model, torch.tensor(req.ids)).logits
        prefix = fuse.prefill(self.model, torch.tensor(req.prefix[:2])).cache  # the rest is computed as a tail
        caches = [fuse.precompute_chunk(self.model, self.preamble, c) for c in req.chunks]
        ids = [torch.tensor(c) for c in req.chunks]
        blended = fuse.blend(self.model, prefix, caches, ids, torch.tensor(req.suffix), 1.0,
                             prefix_tail=torch.tensor(req.prefix[2:]), rotate=self._rotate).logits
        err = float((blended - full).abs().max() / full.abs().max().clamp_min(1.0))
        # Blend at 1.0 overwrites every reused key, so check the move separately: a layer-0 key
        # depends on its token alone, so a re-rotated one must equal one computed at the target.
        chunk, target = caches[1], torch.arange(40, 40 + len(caches[1]))
        moved = torch.empty_like(chunk.k[0])
        self._rotate(moved, chunk.k[0], chunk.positions, target, self.cfg.head_dim, self.cfg.rope(0))
        _, direct, _ = self.model.project(0, self.model.embed(ids[1]), target)
        rot_err = float((moved - direct).abs().max() / direct.abs().max().clamp_min(1e-6))
        if rot_err > SELF_CHECK_TOLERANCE:
            return (
                f"self-check failed: re-rotated keys differ from keys computed at their new positions by "
                f"{rot_err:.2e} (relative) on this model, so modes 'reuse' and 'blend' are disabled; "
                "use 'full' or 'prefix'"
            )
        if err > SELF_CHECK_TOLERANCE:
            return (
                f"self-check failed: blend at ratio 1.0 differs from full prefill by {err:.2e} (relative, "
                f"tolerance {SELF_CHECK_TOLERANCE:.0e}) on this model, so modes 'reuse' and 'blend' are "
                "disabled; use 'full' or 'prefix'"
            )
        return None

    def validate(self, req: Request, mode: str, ratio: Ratio = None, max_tokens: int = 0) -> None:
        if mode not in MODES:
            raise RequestError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode in ("reuse", "blend", "legolink") and self.blend_error:
            raise ModeUnavailableError(self.blend_error)
        if not req.suffix:
            raise RequestError("the request needs a non-empty suffix (the question)")
        if any(len(c) == 0 for c in req.chunks):
            raise RequestError("empty chunks are not allowed; drop them from the request")
        if ratio == "auto":
            if self.controller is None:
                raise RequestError("ratio 'auto' needs the loading controller's profile (run `kvfuse profile`)")
        elif ratio is not None and not (isinstance(ratio, int | float) and 0.0 <= ratio <= 1.0):
            raise RequestError(f"ratio must be a number between 0 and 1 or 'auto', got {ratio!r}")
        limit = self.cfg.max_position_embeddings
        if len(req) + max_tokens > limit:
            raise RequestError(
                f"the prompt has {len(req)} tokens and asks for {max_tokens} more, but the model's context "
                f"window is {limit} tokens; shorten the context or lower max_tokens"
            )
        bad = [t for t in req.ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary of {self.cfg.vocab_size}")

    # -- caches ------------------------------------------------------------------------------------

    def _root(self) -> BlockHash:
        return root_hash(self.fingerprint, self.kv_dtype)

    def block_hashes(self, tokens: Sequence[int], salts: Sequence[Salt] = ()) -> list[BlockHash]:
        """The chained store keys of the full blocks of a prefix."""
        return prefix_block_hashes(self._root(), tokens, self.block_size, salts=salts)

    def _cached_prefix(self, tokens: Sequence[int], salts: Sequence[Salt] = ()) -> list[KVCache]:
        """The longest run of cached full blocks at the start of tokens, in order."""
        blocks = []
        dtype = self.model.embed_tokens.weight.dtype
        with one_thread():
            for h in self.block_hashes(tokens, salts):
                c = self.store.get(h)
                if c is None:
                    break
                blocks.append(c.to(dtype))
        return blocks

    def _store_prefix(
        self, tokens: Sequence[int], cache: KVCache, salts: Sequence[Salt] = (), pin: bool = False
    ) -> None:
        """Store every full block of tokens not yet in the store (cache covers at least tokens)."""
        bs = self.block_size
        with one_thread():  # hundreds of small copies: see kv.one_thread
            for j, h in enumerate(self.block_hashes(tokens, salts)):
                if h not in self.store:
                    self.store.put(h, cache.slice(j * bs, (j + 1) * bs).to(self.kv_dtype).clone(), pin=pin)
                elif pin:
                    self.store.pin(h)

    def _exact_prefix(self, tokens: Sequence[int], salts: Sequence[Salt] = ()) -> KVCache:
        """The exact KV of a prefix: cached blocks plus a prefill of the rest."""
        hit = self._cached_prefix(tokens, salts)
        n_hit = len(hit) * self.block_size
        if n_hit == len(tokens):
            return KVCache.concat(hit) if hit else KVCache.empty(self.cfg)
        rest = torch.tensor(list(tokens[n_hit:]), dtype=torch.int64)
        return fuse.prefill(self.model, rest, past=hit).cache

    def chunk_key(self, chunk: Sequence[int], salt: str = "") -> ChunkKey:
        """The store key of a chunk's cache (computed behind this engine's preamble, in its KV dtype)."""
        return chunk_key(self.fingerprint, self.kv_dtype, self.preamble, chunk, salt)

    def chunk_cache(self, chunk: Sequence[int], salt: str = "") -> tuple[KVCache, bool]:
        """A chunk's cache from the store, computed and stored on a miss; the flag says it was a hit."""
        key = self.chunk_key(chunk, salt)
        cache = self.store.get(key)
        if cache is not None:
            return cache, True
        return self._compute_chunk(chunk, key), False

    def _chunk_source(self, chunk: Sequence[int], key: ChunkKey) -> tuple[LayerSource, bool]:
        """A chunk's cache for layer-wise reading (from memory, lazily from disk, or computed now), and
        whether it came from the store."""
        source = self.store.open(key)
        return (source, True) if source is not None else (self._compute_chunk(chunk, key), False)

    def _promote(self, key: ChunkKey, layers: LayerKV, positions: torch.Tensor) -> None:
        k, v = torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])
        self.store.memory.put(key, KVCache(k, v, positions))

    def _compute_chunk(self, chunk: Sequence[int], key: ChunkKey) -> KVCache:
        cache = fuse.precompute_chunk(self.model, self.preamble, chunk).to(self.kv_dtype)
        self.store.put(key, cache)
        return cache

    @torch.inference_mode()
    def precompute(self, req: Request, mode: str, pin: bool = False) -> float:
        """Prepare the caches that `mode` reuses for this request; returns the seconds spent.

        With pin, the prefix blocks are pinned in the store (a knowledge base's prefix is never evicted)."""
        if mode == "full":
            return 0.0
        t0 = time.perf_counter()
        if mode == "prefix":
            cacheable = list(req.prefix) + [t for c in req.chunks for t in c]
            self.precompute_prefix(cacheable, req.salts, pin)
        elif mode in ("reuse", "blend", "legolink"):
            self.precompute_prefix(req.prefix, req.salts, pin)
            for c in req.chunks:
                key = self.chunk_key(c, req.chunk_salt)
                if key not in self.store:  # cached in any tier is enough: the request loads it
                    self._compute_chunk(c, key)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def precompute_prefix(self, tokens: Sequence[int], salts: Sequence[Salt] = (), pin: bool = False) -> int:
        """Store the full blocks of a prefix, computing only those not cached; returns the tokens computed."""
        hashes = self.block_hashes(tokens, salts)
        n_full = len(hashes) * self.block_size
        if n_full == 0:
            return 0
        cached = 0
        for h in hashes:
            if h not in self.store:
                break
            cached += 1
        if cached == len(hashes):  # cached in some tier; the request itself loads it
            if pin:
                for h in hashes:
                    self.store.pin(h)
            return 0
        self._store_prefix(tokens, self._exact_prefix(tokens[:n_full], salts), salts, pin)
        return n_full - cached * self.block_size

    # -- prefill -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self, req: Request, mode: str = "full", ratio: Ratio = None, head_tokens: int = LEGOLINK_HEAD_TOKENS,
        room: int = 0,
    ) -> Prefilled:
        """Build the request's KV cache and first-token logits in the given mode.

        `room` reserves buffer space for that many decoded tokens, so decoding appends in place."""
        self.validate(req, mode, ratio)
        model, counts = self.model, TokenCounts(prompt=len(req))
        suffix = torch.tensor(req.suffix, dtype=torch.int64)
        writes: list[Callable[[], object]] = []
        if mode == "full":
            fused = fuse.prefill(model, torch.tensor(req.ids, dtype=torch.int64), room=room)
            counts.prefilled = len(req)
            return Prefilled(fused, counts, mode, None)
        if mode == "prefix":
            cacheable = list(req.prefix) + [t for c in req.chunks for t in c]
            hit = self._cached_prefix(cacheable, req.salts)
            n_hit = len(hit) * self.block_size
            rest = torch.tensor(cacheable[n_hit:] + list(req.suffix), dtype=torch.int64)
            fused = fuse.prefill(model, rest, past=hit, room=room)
            counts.reused, counts.prefilled, counts.cached = n_hit, len(req) - n_hit, n_hit
            writes.append(lambda: self._store_prefix(cacheable, fused.cache, req.salts))
            return Prefilled(fused, counts, mode, None, writes)
        # reuse, blend and legolink: cached prefix blocks, the prefix's uncached tail computed with the suffix
        hit = self._cached_prefix(req.prefix, req.salts)
        n_hit = len(hit) * self.block_size
        tail = torch.tensor(req.prefix[n_hit:], dtype=torch.int64)
        counts.reused = n_hit + sum(len(c) for c in req.chunks)
        counts.prefilled = len(req) - counts.reused
        ids = [torch.tensor(c, dtype=torch.int64) for c in req.chunks]
        keys = [self.chunk_key(c, req.chunk_salt) for c in req.chunks]
        opened = [self._chunk_source(c, k) for c, k in zip(req.chunks, keys, strict=True)]
        sources = [s for s, _ in opened]
        stored = torch.cat([torch.full((len(c),), hit) for c, (_, hit) in zip(req.chunks, opened, strict=True)]) \
            if req.chunks else torch.zeros(0, dtype=torch.bool)
        decision = None
        if mode in ("reuse", "legolink"):
            r = None
        elif self.controller is not None:
            tier = "memory" if all(isinstance(s, KVCache) for s in sources) else "disk"
            fixed = None if ratio == "auto" else (fuse.DEFAULT_RATIO if ratio is None else float(ratio))
            decision = self.controller.decide(counts.reused, tier, fixed)
            r = decision.ratio
        else:
            r = fuse.DEFAULT_RATIO if ratio is None else float(ratio)
        for _ in range(len(sources) + 1):  # tries again only when a stored entry turns out corrupt mid-read
            lazy = [i for i, s in enumerate(sources) if not isinstance(s, KVCache)]
            loader = LayerLoader(sources, self.cfg.num_layers, pipelined=self.pipelined and bool(lazy))
            try:
                with loader:
                    if mode == "legolink":
                        fused = fuse.legolink(model, hit, sources, ids, suffix, head_tokens, prefix_tail=tail,
                                              rotate=self._rotate, loader=loader, room=room)
                    elif r is None:
                        fused = fuse.reuse(model, hit, sources, suffix, tail, rotate=self._rotate, loader=loader,
                                           room=room)
                    else:
                        fused = fuse.blend(model, hit, sources, ids, suffix, r, prefix_tail=tail,
                                           rotate=self._rotate, loader=loader, room=room)
                break
            except CorruptEntryError as e:  # drop that entry, recompute its chunk, fuse again
                for i in (i for i in lazy if keys[i] == e.key or e.key is None):
                    self.store.drop_corrupt(keys[i], str(e))
                    sources[i] = self._compute_chunk(req.chunks[i], keys[i])
                    stored[sum(len(c) for c in req.chunks[:i]) : sum(len(c) for c in req.chunks[: i + 1])] = False
        if mode in ("blend", "legolink"):
            counts.recomputed = round(fused.recomputed_token_layers / self.cfg.num_layers)
        recomputed_stored = sum(int(stored[sel].sum()) for sel in fused.selected) / self.cfg.num_layers
        counts.cached = n_hit + int(stored.sum()) - round(recomputed_stored)
        writes.append(lambda: self._store_prefix(req.prefix, fused.cache, req.salts))
        for i in lazy:  # after the request: promote what came from disk into memory, from the layers read
            writes.append(partial(self._promote, keys[i], [kv[i] for kv in loader.loaded], sources[i].positions))
        return Prefilled(fused, counts, mode, r, writes, decision)

    # -- decoding ----------------------------------------------------------------------------------

    def greedy_head(self) -> GreedyHead | None:
        """The int8 screen of the LM head for exact greedy steps, built on first use (None: not used)."""
        if self._greedy_head is False:
            self._greedy_head = GreedyHead.build(self.model.head_weight()) if self.greedy_screen else None
        return self._greedy_head  # type: ignore[return-value]

    def stream(
        self,
        req: Request,
        mode: str = "full",
        ratio: Ratio = None,
        params: SamplingParams | None = None,
        *,
        head_tokens: int = LEGOLINK_HEAD_TOKENS,
        score: Sequence[int] | None = None,
        record_logits: bool = False,
    ) -> TokenStream:
        """Generate token ids one at a time; the stream's `result` holds timings and counts at the end.

        `score` is a continuation to teacher-force on the same prompt cache after the first token
        (its logits land in `result.scored_logits`; not part of TTFT); `record_logits` keeps the
        logits of every generated step in `result.step_logits`."""
        params = params or SamplingParams()
        self.validate(req, mode, ratio, params.max_tokens)
        opts = _Extras(head_tokens, tuple(score) if score is not None else None, record_logits)
        return TokenStream(lambda out: self._generate(req, mode, ratio, params, out, opts))

    def generate(
        self,
        req: Request,
        mode: str = "full",
        ratio: Ratio = None,
        params: SamplingParams | None = None,
        **extras: Any,
    ) -> Generation:
        stream = self.stream(req, mode, ratio, params, **extras)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    @torch.inference_mode()
    def begin(
        self, req: Request, mode: str = "full", ratio: Ratio = None, params: SamplingParams | None = None,
        *, head_tokens: int = LEGOLINK_HEAD_TOKENS, score: Sequence[int] | None = None,
        record_logits: bool = False,
    ) -> Decoding:
        """Prefill a request, choose its first token and run its store writes; `advance` then moves it
        (with others) on, and `close()` returns its Generation."""
        params = params or SamplingParams()
        self.validate(req, mode, ratio, params.max_tokens)
        t0 = time.perf_counter()
        before = self.store.stats.snapshot()
        pre = self.prefill(req, mode, ratio, head_tokens, room=params.max_tokens)
        store_stats = self.store.stats.since(before)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        stop = set(params.stop_token_ids if params.stop_token_ids is not None else self.cfg.eos_token_ids)
        if params.ignore_eos:
            stop = set()
        first = sample(pre.fused.logits, params, gen)
        d = Decoding(pre, params, stop, gen, t0, time.perf_counter() - t0, store_stats, record_logits)
        for write in pre.writeback:  # now, not at the end: a request started next finds what this one stored,
            write()  # whether this one is still decoding or not
        d.scored = self._score(pre.fused, score) if score else None
        d.take(first)
        return d

    @torch.inference_mode()
    def advance(self, batch: Sequence[Decoding]) -> None:
        """Move every unfinished request in the batch on by one token, stepping them together in groups
        of at most `decode_batch_limit()`: each gets exactly the token it would get stepped alone.

        A failure of one request's own (its sampling) ends it with `error` set; a failure of the step
        itself raises."""
        live = [d for d in batch if not d.done]
        size = self.decode_batch_limit() if len(live) > 1 else 1
        for at in range(0, len(live), size):
            self._step(live[at : at + size])

    def _step(self, live: list[Decoding]) -> None:
        for d in live:
            if d.slot is None:
                d.slot = Slot(self.model, d.pre.fused.cache, d.params.max_tokens, d.pre.fused.buffers)
        h = step_hidden(self.model, [d.slot for d in live], [d.tokens[-1] for d in live])  # type: ignore[misc]
        greedy = [j for j, d in enumerate(live) if d.params.temperature < MIN_TEMPERATURE and d.steps is None]
        head = self.greedy_head() if greedy else None
        chosen: dict[int, int] = {}
        if head is not None:  # only the argmax is needed: screen the head, exactly, for all of them at once
            chosen = dict(zip(greedy, head.argmax_rows(self.model.norm(h[greedy])), strict=True))
        for j, d in enumerate(live):
            try:
                if j not in chosen:
                    logits = self.model.logits(h[j : j + 1])[0]
                    if d.steps is not None:
                        d.steps.append(logits)
                    chosen[j] = sample(logits, d.params, d.gen)
                d.take(chosen[j])
            except Exception as e:  # this request's own failure (its sampling): the others go on
                d.fail(e)

    def decode_batch_limit(self) -> int:
        """How many requests `advance` steps together on this model and machine with every answer
        unchanged, up to MAX_DECODE_BATCH (checked once: about a second on Gemma 3 270M)."""
        if self._batch_limit is None:
            with torch.inference_mode():
                self._batch_limit = batch_limit(self.model, MAX_DECODE_BATCH, self.greedy_head())
            log.info("decoding steps up to %d requests together", self._batch_limit)
        return self._batch_limit

    def _generate(
        self, req: Request, mode: str, ratio: Ratio, params: SamplingParams, out: TokenStream, opts: _Extras
    ) -> Generator[int, None, None]:
        d = self.begin(req, mode, ratio, params, head_tokens=opts.head_tokens, score=opts.score,
                       record_logits=opts.record_logits)
        try:
            sent = 0
            while True:
                while sent < len(d.tokens):
                    sent += 1
                    yield d.tokens[sent - 1]
                if d.error is not None:
                    raise d.error
                if d.done:
                    return
                self.advance([d])
        finally:
            out.result = d.close()

    @torch.inference_mode()
    def _score(self, fused: fuse.Fused, ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits (len(ids), vocab): row i predicts ids[i] after the prompt and ids[:i]."""
        slot = Slot(self.model, fused.cache, len(ids))
        rows = [fused.logits] + [self.model.logits(step_hidden(self.model, [slot], [t]))[0] for t in ids[:-1]]
        return torch.stack(rows).float()


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
                self.tokens, self.ttft, time.perf_counter() - self.t0, pre.counts, pre.fused.logits,
                self.finish_reason, pre.mode, pre.ratio, self.store, pre.controller,
                torch.stack(self.steps).float() if self.steps else None, self.scored,
            )
        return self.result


@dataclass(frozen=True, slots=True)
class _Extras:
    head_tokens: int
    score: tuple[int, ...] | None
    record_logits: bool
