"""The store the engine talks to: memory first, then disk, with write-back to disk in the background."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field, replace
from typing import Protocol, cast

from kvfuse.kv import KVCache
from kvfuse.loader import LayerSource
from kvfuse.store.keys import CacheKey
from kvfuse.store.memory import MemoryTier, TierStats

log = logging.getLogger(__name__)


class Tier(Protocol):
    """What a storage tier offers (memory and disk here; a shared Redis tier would add itself the same way)."""

    name: str
    stats: TierStats

    @property
    def capacity_bytes(self) -> int: ...

    def __contains__(self, key: CacheKey) -> bool: ...
    def get(self, key: CacheKey) -> KVCache | None: ...
    def put(self, key: CacheKey, cache: KVCache, pin: bool = False) -> bool: ...
    def pin(self, key: CacheKey) -> None: ...
    def unpin(self, key: CacheKey) -> None: ...

    @property
    def used_bytes(self) -> int: ...


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


class TieredStore:
    """Lookups go memory, then disk (a disk hit is promoted to memory). New entries go to memory at
    once and are written back to disk by a background thread; `flush()` waits for the writes."""

    def __init__(self, memory: MemoryTier | None = None, disk: Tier | None = None) -> None:
        self.memory = memory if memory is not None else MemoryTier()
        self.disk = disk
        self.stats = StoreStats()
        self._queue: queue.Queue[tuple[CacheKey, KVCache, bool] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def tiers(self) -> list[Tier]:
        return [self.memory] + ([self.disk] if self.disk is not None else [])

    def __contains__(self, key: CacheKey) -> bool:
        return any(key in t for t in self.tiers)

    def get(self, key: CacheKey) -> KVCache | None:
        cache = self.memory.get(key)
        if cache is not None:
            self._hit("memory", 0)
            return cache
        if self.disk is not None:
            corrupt_before = getattr(self.disk, "corrupt", 0)
            cache = self.disk.get(key)
            self.stats.corrupt += getattr(self.disk, "corrupt", 0) - corrupt_before
            if cache is not None:
                self._hit("disk", cache.nbytes)
                self.memory.put(key, cache)
                return cache
        self.stats.misses += 1
        return None

    def open(self, key: CacheKey) -> LayerSource | None:
        """An entry for per-layer reads: a memory hit as it is, a disk hit opened lazily (its layers are
        read, and verified, when the loader asks for them)."""
        cache = self.memory.get(key)
        if cache is not None:
            self._hit("memory", 0)
            return cache
        opener = getattr(self.disk, "open", None)
        if opener is not None:
            corrupt_before = getattr(self.disk, "corrupt", 0)
            entry = opener(key)
            self.stats.corrupt += getattr(self.disk, "corrupt", 0) - corrupt_before
            if entry is not None:
                self._hit("disk", entry.info.nbytes)
                return cast(LayerSource, entry)
        elif self.disk is not None:
            return self.get(key)
        self.stats.misses += 1
        return None

    def drop_corrupt(self, key: CacheKey, why: str) -> None:
        """An entry failed verification while being read: forget it everywhere."""
        self.stats.corrupt += 1
        drop = getattr(self.disk, "drop_corrupt", None)
        if drop is not None:
            drop(key, why)

    def _hit(self, tier: str, nbytes: int) -> None:
        self.stats.hits += 1
        self.stats.bytes_read += nbytes
        self.stats.tier_hits[tier] = self.stats.tier_hits.get(tier, 0) + 1

    def put(self, key: CacheKey, cache: KVCache, pin: bool = False) -> bool:
        stored = self.memory.put(key, cache, pin)
        if self.disk is not None and key not in self.disk:
            self._start_writer()
            self._queue.put((key, cache, pin))
        return stored

    def pin(self, key: CacheKey) -> None:
        for t in self.tiers:
            t.pin(key)

    def unpin(self, key: CacheKey) -> None:
        for t in self.tiers:
            t.unpin(key)

    def flush(self) -> None:
        """Wait until every queued disk write has finished."""
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
        assert self.disk is not None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, cache, pin = item
                self.disk.put(key, cache, pin)
            except Exception:  # a failed write-back must never take requests down
                log.exception("write-back to the disk tier failed")
            finally:
                self._queue.task_done()
