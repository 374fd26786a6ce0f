"""The in-memory tier: a byte-capacity LRU map from cache keys to KV caches."""

from __future__ import annotations

import threading

from kvfuse.kv import KVCache
from kvfuse.store.base import TierSettings, TierStats, register_tier
from kvfuse.store.keys import CacheKey
from kvfuse.store.lru import LruIndex


class MemoryTier:
    """LRU over entries by bytes. Eviction order: least recently used (get or put) first; pinned
    entries are never evicted. An entry larger than the capacity left beside the pins is not kept."""

    name = "memory"

    def __init__(self, capacity_bytes: int = 4 << 30) -> None:
        self._index: LruIndex[KVCache] = LruIndex(capacity_bytes)
        self._lock = threading.Lock()
        self.stats = TierStats()
        self.corrupt = 0  # entries in memory are never verified, so none are ever dropped as corrupt

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[CacheKey]:
        return self._index.keys()

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def get(self, key: CacheKey) -> KVCache | None:
        with self._lock:
            cache = self._index.get(key)
            if cache is None:
                self.stats.misses += 1
                return None
            self._index.touch(key)
            self.stats.hits += 1
            return cache

    def open(self, key: CacheKey) -> KVCache | None:
        """An entry in memory is read as it is."""
        return self.get(key)

    def put(self, key: CacheKey, cache: KVCache, pin: bool = False) -> bool:
        """Insert (or refresh) an entry; returns False if it cannot fit even after eviction."""
        with self._lock:
            if key in self._index:
                self._index.touch(key)
                if pin:
                    self._index.pin(key)
                return True
            if cache.nbytes > self.capacity_bytes - self._index.pinned_bytes:
                return False
            self.stats.evictions += len(self._index.add(key, cache, cache.nbytes, pin))
            return True

    def pinned(self) -> set[CacheKey]:
        """The keys held pinned (never evicted)."""
        with self._lock:
            return self._index.pinned()

    def pin(self, key: CacheKey) -> None:
        with self._lock:
            self._index.pin(key)

    def unpin(self, key: CacheKey) -> None:
        with self._lock:
            self.stats.evictions += len(self._index.unpin(key))

    def drop_corrupt(self, key: CacheKey, why: str) -> None:
        """Forget an entry that failed verification in another tier (its copy here came from there)."""
        with self._lock:
            self._index.pop(key)


@register_tier("memory")
def _memory(settings: TierSettings) -> MemoryTier:
    return MemoryTier(settings.capacity_bytes)
