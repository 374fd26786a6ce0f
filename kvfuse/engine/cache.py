"""The engine's side of the store: a request's cache keys, prefix lookups and stores, chunk sources,
the corrupt-entry retry and write-backs. Token ids only.

Keys are computed once: `block_hashes` remembers the chained hashes of the last prefixes it was asked
about (a knowledge base's prefix is hashed once per process, not once per lookup, build, store and
quote request), and a request's keys are computed at once, in `request_keys`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvfuse import fuse
from kvfuse.fuse import FuseContext, Fused, FuseLayout, Fuser
from kvfuse.kv import KVCache, Residual, one_thread
from kvfuse.loader import LayerLoader, LayerSource, OnDevice, on_device
from kvfuse.model import Decoder
from kvfuse.request import Request, Salt, SaltSpan
from kvfuse.store.base import CorruptEntryError
from kvfuse.store.keys import BlockHash, ChunkKey, chunk_key, prefix_block_hashes, root_hash, tail_block_hash
from kvfuse.store.tiered import TieredStore

HASH_MEMO = 32  # prefixes whose block hashes are remembered


@dataclass(frozen=True, slots=True)
class RequestKeys:
    """The store keys a request reads under a fuser: its cacheable prefix's chained block hashes, and its
    chunks' keys with what each is computed behind and the layer whose residual stream each keeps."""

    blocks: tuple[BlockHash, ...]
    chunks: tuple[ChunkKey, ...] = ()
    preambles: tuple[tuple[int, ...], ...] = ()
    residual: int | None = None
    tail: BlockHash | None = None  # the cacheable prefix's trailing partial block (`tail_key`), if any


@dataclass(slots=True)
class ChunkSet:
    """A request's chunk caches, opened for per-layer reads: from the store, or computed now on a miss.

    `stored[i]`: chunk i came from the store; `promote[i]`: from a later tier, so the layers read are
    put into the first tier after the request; `tier`: the slowest tier any chunk is read from;
    `preambles`: what each of them is computed behind; `residual`: the layer whose residual stream
    each keeps (`kv.Residual`), if the fuser asks for one."""

    keys: list[ChunkKey]
    sources: list[LayerSource]
    stored: list[bool]
    promote: list[bool]
    tier: str
    lengths: list[int] = field(default_factory=list)
    preambles: tuple[tuple[int, ...], ...] = ()
    residual: int | None = None

    def stored_mask(self) -> torch.Tensor:
        """(chunk tokens,) bool: the token's KV came from the store."""
        if not self.sources:
            return torch.zeros(0, dtype=torch.bool)
        return torch.cat([torch.full((n,), s) for n, s in zip(self.lengths, self.stored, strict=True)])


class CacheManager:
    """Keys, lookups and stores of one model's caches (one fingerprint, preamble and KV dtype)."""

    def __init__(self, model: Decoder, fingerprint: str, store: TieredStore, preamble: Sequence[int],
                 block_size: int, kv_dtype: torch.dtype) -> None:
        self.model, self.fingerprint, self.store = model, fingerprint, store
        self.preamble, self.block_size, self.kv_dtype = tuple(preamble), block_size, kv_dtype
        self.root = root_hash(fingerprint, kv_dtype)
        self._lock = threading.Lock()
        self._hashes: OrderedDict[tuple[tuple[int, ...], tuple[SaltSpan, ...]], tuple[BlockHash, ...]] = OrderedDict()
        self._tails: OrderedDict[tuple[tuple[int, ...], tuple[SaltSpan, ...]], BlockHash | None] = OrderedDict()

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes on every layer, stored in the KV dtype."""
        return self.model.cfg.kv_bytes_per_token // 4 * self.kv_dtype.itemsize

    # -- prefix blocks -----------------------------------------------------------------------------

    def block_hashes(self, tokens: Sequence[int], salts: Sequence[SaltSpan] = ()) -> tuple[BlockHash, ...]:
        """The chained store keys of the full blocks of a prefix (remembered for the last few prefixes)."""
        key = (tuple(tokens), tuple(salts))
        with self._lock:  # the server's HTTP threads and its worker both ask
            hit = self._hashes.pop(key, None)
            if hit is not None:
                self._hashes[key] = hit  # most recently used last
                return hit
        hashes = tuple(prefix_block_hashes(self.root, key[0], self.block_size, salts=[s.range for s in salts]))
        with self._lock:
            self._hashes[key] = hashes
            while len(self._hashes) > HASH_MEMO:
                self._hashes.popitem(last=False)
        return hashes

    def request_keys(self, req: Request, fuser: Fuser) -> RequestKeys:
        """Every store key the request reads under the fuser, computed at once: the chained hashes of its
        cacheable prefix (its own prefix; everything before the suffix for a mode that reads no chunk
        caches) and its chunks' keys."""
        chunked = fuser.reads == "chunks"
        cacheable = req.prefix if chunked else tuple(req.prefix) + tuple(t for c in req.chunks for t in c)
        behind, residual = (self.chunk_preambles(fuser, req), fuse.residual_layer(fuser)) if chunked else ((), None)
        blocks = self.block_hashes(cacheable, req.salts)
        if not chunked:
            return RequestKeys(blocks, tail=self.tail_key(cacheable, req.salts, blocks))
        salt = req.chunk_salt.key if req.chunk_salt else ""
        return RequestKeys(blocks, tuple(chunk_key(self.fingerprint, self.kv_dtype, b, c, salt, residual)
                                         for c, b in zip(req.chunks, behind, strict=True)), behind, residual)

    def tail_key(self, tokens: Sequence[int], salts: Sequence[SaltSpan], hashes: Sequence[BlockHash]
                 ) -> BlockHash | None:
        """The store key of a prefix's trailing partial block (None: it ends on a block boundary), chained
        after its full blocks' `hashes`. A cached knowledge base's prefix rarely ends on a boundary, and
        without its tail cached every question computes those tokens again (11 of a 35-token question on
        the Albarán prefix: 132 against 95 ms of TTFT, docs/benchmarks.md, stop 50)."""
        key = (tuple(tokens), tuple(salts))
        with self._lock:
            if key in self._tails:
                return self._tails[key]
        tail = tail_block_hash(hashes[-1] if hashes else self.root, key[0], self.block_size,
                               salts=[s.range for s in salts])
        with self._lock:  # remembered like the blocks' hashes
            self._tails[key] = tail
            while len(self._tails) > HASH_MEMO:
                self._tails.popitem(last=False)
        return tail

    def read_tail(self, key: BlockHash | None, n: int) -> KVCache | None:
        """The stored tail of n tokens under key, as `read_prefix` gives blocks; None where there is none."""
        cache = self.store.get(key) if key is not None else None
        if cache is None or len(cache) != n:
            return None
        return cache.to(device=self.model.device)

    def store_tail(self, key: BlockHash | None, cache: KVCache, start: int, end: int) -> None:
        """Store positions start:end of cache (a prefix's tail, as a request computed it) under key,
        unpinned: a few tokens, computed again if evicted."""
        if key is not None and end > start and key not in self.store:
            with one_thread():
                self.store.put(key, cache.slice(start, end).clone(self.kv_dtype))

    def stored_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many blocks at the start are stored in some tier (nothing is read)."""
        n = 0
        for h in hashes:
            if h not in self.store:
                break
            n += 1
        return n

    def read_prefix(self, hashes: Sequence[BlockHash]) -> list[KVCache]:
        """The longest run of stored blocks at the start, in order, in the dtype they are stored in (on the
        model's device): a request's buffers take them in the compute dtype as they copy them
        (`fuse.core._copy_in`). The memory tier's blocks come back as the very objects it holds, which is
        how a kept buffer knows it holds them already (`buffers.py`); a converted copy would match nothing."""
        blocks = []
        device = self.model.device
        with one_thread():
            for h in hashes:
                c = self.store.get(h)
                if c is None:
                    break
                blocks.append(c.to(device=device))
        return blocks

    def store_prefix(self, hashes: Sequence[BlockHash], cache: KVCache, pin: bool = False) -> None:
        """Store every block not yet stored (cache covers at least the blocks)."""
        bs = self.block_size
        with one_thread():  # hundreds of small copies: see kv.one_thread
            for j, h in enumerate(hashes):
                if h not in self.store:
                    self.store.put(h, cache.slice(j * bs, (j + 1) * bs).clone(self.kv_dtype), pin=pin)
                elif pin:
                    self.store.pin(h)

    def precompute_prefix(self, tokens: Sequence[int], salts: Sequence[SaltSpan] = (), pin: bool = False,
                          hashes: Sequence[BlockHash] | None = None, tail: bool = True) -> int:
        """Store the full blocks of a prefix, and its tail entry (`tail_key`) unless `tail` is False,
        computing only what is not stored; returns the tokens computed.

        `hashes` may be given when they are known (the first blocks of a longer prefix's hashes)."""
        hashes = self.block_hashes(tokens, salts) if hashes is None else hashes
        n_full = len(hashes) * self.block_size
        tail_key = self.tail_key(tokens, salts, hashes) if tail else None
        stored = self.stored_blocks(hashes)
        if stored == len(hashes) and (tail_key is None or tail_key in self.store):  # the request loads it
            if pin:
                for h in hashes:
                    self.store.pin(h)
            return 0
        hit = self.read_prefix(hashes)
        n_hit = len(hit) * self.block_size
        end = n_full if tail_key is None else len(tokens)
        exact = KVCache.concat(hit) if n_hit == end else fuse.prefill(
            self.model, torch.tensor(list(tokens[n_hit:end]), dtype=torch.int64), past=hit).cache
        self.store_prefix(hashes, exact, pin)
        self.store_tail(tail_key, exact, n_full, end)
        return end - stored * self.block_size

    # -- chunks ------------------------------------------------------------------------------------

    def chunk_preambles(self, fuser: Fuser, req: Request) -> tuple[tuple[int, ...], ...]:
        """What each of the request's chunk caches is computed behind, for this fuser (`fuse.BEHIND`)."""
        return fuse.chunk_preambles(fuser, req.prefix, req.chunks, self.preamble)

    def _behind(self, preamble: Sequence[int] | None) -> tuple[int, ...]:
        """A chunk's preamble: the one given, else the engine's (BOS)."""
        return self.preamble if preamble is None else tuple(preamble)

    def chunk_key(self, chunk: Sequence[int], salt: Salt | None = None,
                  preamble: Sequence[int] | None = None, residual: int | None = None) -> ChunkKey:
        """The store key of a chunk's cache (computed behind the preamble, by default the engine's, in the
        KV dtype; with `residual`, keeping that layer's residual stream)."""
        salted = salt.key if salt else ""
        return chunk_key(self.fingerprint, self.kv_dtype, self._behind(preamble), chunk, salted, residual)

    def chunk_cache(self, chunk: Sequence[int], salt: Salt | None = None,
                    preamble: Sequence[int] | None = None, residual: int | None = None) -> tuple[KVCache, bool]:
        """A chunk's cache from the store, computed and stored on a miss; the flag says it was a hit."""
        key = self.chunk_key(chunk, salt, preamble, residual)
        cache = self.store.get(key)
        if cache is not None:
            return cache.to(device=self.model.device), True
        return self.compute_chunk(chunk, key, preamble, residual=residual), False

    def compute_chunk(self, chunk: Sequence[int], key: ChunkKey, preamble: Sequence[int] | None = None,
                      pause: fuse.Pause = fuse.no_pause, residual: int | None = None) -> KVCache:
        cache = fuse.precompute_chunk(self.model, self._behind(preamble), chunk, pause=pause,
                                      residual=residual).to(self.kv_dtype)
        self.store.put(key, cache)
        return cache

    def open_chunks(self, req: Request, keys: RequestKeys, pause: fuse.Pause = fuse.no_pause) -> ChunkSet:
        """Every chunk's cache for layer-wise reading: from memory, lazily from a later tier, or computed
        now (behind its preamble, keeping the residual stream `keys` name); `pause` is called between the
        layers of a chunk computed now."""
        first, residual = self.store.tiers[0].name, keys.residual
        out = ChunkSet([], [], [], [], first, [len(c) for c in req.chunks], keys.preambles, residual)
        slowest = 0
        names = [t.name for t in self.store.tiers]
        for c, behind, key in zip(req.chunks, keys.preambles, keys.chunks, strict=True):
            opened = self.store.open(key)
            out.keys.append(key)
            if opened is None:
                out.sources.append(self.compute_chunk(c, key, behind, pause, residual))
                out.stored.append(False)
                out.promote.append(False)
                continue
            out.sources.append(on_device(opened.source, self.model.device))
            out.stored.append(True)
            out.promote.append(opened.promote)
            slowest = max(slowest, names.index(opened.tier))
        out.tier = names[slowest]
        return out

    def fuse(self, fuser: Fuser, layout: Callable[[Sequence[LayerSource]], FuseLayout], ratio: float | None,
             chunks: ChunkSet, req: Request, rotate: fuse.Rerotate, room: int, pipelined: bool,
             pause: fuse.Pause = fuse.no_pause) -> tuple[Fused, LayerLoader]:
        """Run the fuser over the chunk set; an entry that turns out corrupt mid-read is dropped, its
        chunk recomputed, and the fusion run again."""
        for _ in range(len(chunks.sources) + 1):
            lazy = [i for i, p in enumerate(chunks.promote) if p]
            # reads worth running ahead: a later tier's, and every copy from host memory to an accelerator
            ahead = bool(lazy) or any(isinstance(s, OnDevice) for s in chunks.sources)
            loader = LayerLoader(chunks.sources, self.model.cfg.num_layers, pipelined=pipelined and ahead)
            try:
                with loader:
                    ctx = FuseContext(rotate, loader, room, pause)
                    return fuser.fuse(self.model, layout(chunks.sources), ratio, ctx), loader
            except CorruptEntryError as e:
                for i in (i for i in lazy if chunks.keys[i] == e.key or e.key is None):
                    self.store.drop_corrupt(chunks.keys[i], str(e))
                    chunks.sources[i] = self.compute_chunk(req.chunks[i], chunks.keys[i], chunks.preambles[i],
                                                           pause, chunks.residual)
                    chunks.stored[i] = chunks.promote[i] = False
        raise RuntimeError("every stored chunk entry was corrupt and recomputed, yet the fusion still failed")

    def promotions(self, chunks: ChunkSet, loader: LayerLoader) -> list[Callable[[], object]]:
        """Write-backs for after the request: promote what came from a later tier, from the layers read."""
        from functools import partial

        return [partial(self.store.promote, chunks.keys[i], [kv[i] for kv in loader.loaded],
                        chunks.sources[i].positions, Residual.read(chunks.sources[i].residual_at, chunks.residual))
                for i, p in enumerate(chunks.promote) if p]

    def precompute(self, req: Request, fuser: Fuser, pin: bool = False) -> float:
        """Prepare the caches the fuser reads for this request; returns the seconds spent.

        With pin, the prefix blocks are pinned in the store (a knowledge base's prefix is never evicted)."""
        if fuser.reads == "nothing":
            return 0.0
        t0 = time.perf_counter()
        keys = self.request_keys(req, fuser)
        if fuser.reads == "prefix":
            self.precompute_prefix(list(req.prefix) + [t for c in req.chunks for t in c], req.salts, pin, keys.blocks)
        else:
            self.precompute_prefix(req.prefix, req.salts, pin, keys.blocks, tail=False)  # (the fusers read no tail)
            for c, behind, key in zip(req.chunks, keys.preambles, keys.chunks, strict=True):
                if key not in self.store:  # stored in any tier is enough: the request loads it
                    self.compute_chunk(c, key, behind, residual=keys.residual)
        return time.perf_counter() - t0
