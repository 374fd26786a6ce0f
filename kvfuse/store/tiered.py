"""The store the engine talks to: an ordered list of tiers, fastest first, with background write-back.

Lookups go through the tiers in order; a hit in a later tier is promoted into the first one. New
entries go into the first tier at once and into every later tier from one background thread, in
order; `flush()` waits for those writes. Eviction is each tier's own (LRU, pinned entries never).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from kvfuse.kv import HOST, KVCache, Residual
from kvfuse.loader import LayerKV, LayerSource
from kvfuse.store.base import SharedLocks, Tier
from kvfuse.store.keys import CacheKey
from kvfuse.store.memory import MemoryTier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StoreStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    tier_hits: dict[str, int] = field(default_factory=dict)

    @property
    def tiers_used(self) -> set[str]:
        return {t for t, n in self.tier_hits.items() if n > 0}

    def since(self, before: StoreStats) -> StoreStats:
        """What happened between the snapshot `before` and now."""
        return StoreStats(
            self.hits - before.hits,
            self.misses - before.misses,
            self.corrupt - before.corrupt,
            self.bytes_read - before.bytes_read,
            {t: n - before.tier_hits.get(t, 0) for t, n in self.tier_hits.items()},
        )

    def snapshot(self) -> StoreStats:
        return replace(self, tier_hits=dict(self.tier_hits))

    def as_dict(self) -> dict[str, object]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "corrupt": self.corrupt,
            "bytes_read": self.bytes_read,
            "tiers_used": sorted(self.tiers_used),
        }


@dataclass(frozen=True, slots=True)
class Opened:
    """An entry opened for per-layer reads, and the tier it came from. `promote` is set when it came
    from a later tier: the layers read should then be put into the first tier."""

    source: LayerSource
    tier: str
    promote: bool


class TieredStore:
    """Tiers in order, fastest first (default: one memory tier). See the module docstring."""

    def __init__(self, tiers: Sequence[Tier] | None = None) -> None:
        self.tiers: list[Tier] = list(tiers) if tiers else [MemoryTier()]
        self.stats = StoreStats()
        self._queue: queue.Queue[tuple[CacheKey, KVCache, bool] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._lock = threading.Lock()

    def tier(self, name: str) -> Tier | None:
        """The tier of that name, if the store has one."""
        return next((t for t in self.tiers if t.name == name), None)

    def __contains__(self, key: CacheKey) -> bool:
        return any(key in t for t in self.tiers)

    def get(self, key: CacheKey) -> KVCache | None:
        """The whole entry from the first tier that has it (promoted into the first tier)."""
        for i, t in enumerate(self.tiers):
            before = t.corrupt
            cache = t.get(key)
            self.stats.corrupt += t.corrupt - before
            if cache is not None:
                self._hit(t.name, cache.nbytes if i else 0)
                if i:
                    self.tiers[0].put(key, cache)
                return cache
        self.stats.misses += 1
        return None

    def open(self, key: CacheKey) -> Opened | None:
        """The entry for per-layer reads from the first tier that has it; a later tier's entry is read
        (and verified) layer by layer as the loader asks."""
        for i, t in enumerate(self.tiers):
            before = t.corrupt
            source = t.open(key)
            self.stats.corrupt += t.corrupt - before
            if source is not None:
                self._hit(t.name, source.nbytes if i else 0)
                return Opened(source, t.name, i > 0)
        self.stats.misses += 1
        return None

    def promote(self, key: CacheKey, layers: LayerKV, positions: object, residual: Residual | None = None) -> None:
        """Put the layers read from a later tier (and the entry's residual stream, if it has one) into the
        first one."""
        import torch

        k, v = torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])
        assert isinstance(positions, torch.Tensor)
        self.tiers[0].put(key, KVCache(k, v, positions, residual).to(device=HOST))

    def drop_corrupt(self, key: CacheKey, why: str) -> None:
        """An entry failed verification while being read: forget it in every tier."""
        self.stats.corrupt += 1
        for t in self.tiers:
            t.drop_corrupt(key, why)

    def _hit(self, tier: str, nbytes: int) -> None:
        self.stats.hits += 1
        self.stats.bytes_read += nbytes
        self.stats.tier_hits[tier] = self.stats.tier_hits.get(tier, 0) + 1

    def put(self, key: CacheKey, cache: KVCache, pin: bool = False) -> bool:
        """Store an entry in the first tier (and, by the writer, in every later one); an entry computed
        on an accelerator is copied to host memory first."""
        cache = cache.to(device=HOST)
        stored = self.tiers[0].put(key, cache, pin)
        if len(self.tiers) > 1:  # the writer asks each later tier whether it has the key (a remote tier's
            self._start_writer()  # lookup stays off the caller's thread)
            self._queue.put((key, cache, pin))
        return stored

    def pin(self, key: CacheKey) -> None:
        for t in self.tiers:
            t.pin(key)

    def unpin(self, key: CacheKey) -> None:
        for t in self.tiers:
            t.unpin(key)

    @contextmanager
    def exclusive(self, name: str) -> Iterator[bool]:
        """Hold a lock shared by every process of the store's shared tier (Redis) while the block runs;
        yields whether it is held. Without a shared tier there is no one to exclude: yields True."""
        shared = next((t for t in self.tiers if isinstance(t, SharedLocks)), None)
        if shared is None:
            yield True
            return
        with shared.exclusive(name) as held:
            yield held

    def flush(self) -> None:
        """Wait until every queued write-back has finished."""
        self._queue.join()

    def close(self) -> None:
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    def _start_writer(self) -> None:
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="kvfuse-writeback", daemon=True)
                self._writer.start()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, cache, pin = item
                for t in self.tiers[1:]:
                    if key not in t:
                        t.put(key, cache, pin)
            except Exception:  # a failed write-back must never take requests down
                log.exception("write-back to a store tier failed")
            finally:
                self._queue.task_done()
