"""The in-memory tier: a byte-capacity LRU map from cache keys to KV caches."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from kvfuse.kv import KVCache
from kvfuse.store.keys import CacheKey


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class MemoryTier:
    """LRU over entries by bytes. Eviction order: least recently used (get or put) first; pinned
    entries are never evicted. An entry larger than the whole capacity is not kept."""

    name = "memory"

    def __init__(self, capacity_bytes: int = 4 << 30) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[CacheKey, KVCache] = OrderedDict()
        self._pinned: set[CacheKey] = set()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = TierStats()

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def get(self, key: CacheKey) -> KVCache | None:
        with self._lock:
            cache = self._entries.get(key)
            if cache is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return cache

    def put(self, key: CacheKey, cache: KVCache, pin: bool = False) -> bool:
        """Insert (or refresh) an entry; returns False if it cannot fit even after eviction."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                if pin:
                    self._pinned.add(key)
                return True
            if cache.nbytes > self.capacity_bytes - self._pinned_bytes():
                return False
            self._entries[key] = cache
            self._bytes += cache.nbytes
            if pin:
                self._pinned.add(key)
            self._evict()
            return True

    def pin(self, key: CacheKey) -> None:
        with self._lock:
            if key in self._entries:
                self._pinned.add(key)

    def unpin(self, key: CacheKey) -> None:
        with self._lock:
            self._pinned.discard(key)
            self._evict()

    def _pinned_bytes(self) -> int:
        return sum(self._entries[k].nbytes for k in self._pinned if k in self._entries)

    def _evict(self) -> None:
        for key in list(self._entries):
            if self._bytes <= self.capacity_bytes:
                return
            if key in self._pinned:
                continue
            self._bytes -= self._entries.pop(key).nbytes
            self.stats.evictions += 1
