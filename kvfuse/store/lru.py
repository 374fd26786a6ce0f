"""The bookkeeping every tier shares: sized entries in least-recently-used order, with pins."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from kvfuse.store.keys import CacheKey

V = TypeVar("V")


class LruIndex(Generic[V]):
    """Entries (a value and its size in bytes) from least to most recently used. Eviction takes the
    least recently used unpinned entries until the total fits the capacity; pinned entries are never
    evicted. Not thread-safe: each tier calls it under its own lock."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[CacheKey, tuple[V, int]] = OrderedDict()
        self._pinned: set[CacheKey] = set()
        self.used_bytes = 0

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[CacheKey]:
        return list(self._entries)

    def get(self, key: CacheKey) -> V | None:
        """The value, without counting as a use."""
        item = self._entries.get(key)
        return item[0] if item is not None else None

    def touch(self, key: CacheKey) -> None:
        self._entries.move_to_end(key)

    def pinned(self) -> set[CacheKey]:
        return set(self._pinned)

    @property
    def pinned_bytes(self) -> int:
        return sum(self._entries[k][1] for k in self._pinned)

    def add(self, key: CacheKey, value: V, nbytes: int, pin: bool = False, evict: bool = True) -> list[V]:
        """Insert (or replace) an entry as the most recent; returns the values evicted to make room."""
        self.pop(key)
        self._entries[key] = (value, nbytes)
        self.used_bytes += nbytes
        if pin:
            self._pinned.add(key)
        return self.evict() if evict else []

    def pop(self, key: CacheKey) -> V | None:
        item = self._entries.pop(key, None)
        self._pinned.discard(key)
        if item is None:
            return None
        self.used_bytes -= item[1]
        return item[0]

    def pin(self, key: CacheKey) -> None:
        if key in self._entries:
            self._pinned.add(key)

    def unpin(self, key: CacheKey) -> list[V]:
        self._pinned.discard(key)
        return self.evict()

    def oldest_unpinned(self, exclude: CacheKey | None = None) -> CacheKey | None:
        """The least recently used entry that may be evicted."""
        return next((k for k in self._entries if k not in self._pinned and k != exclude), None)

    def evict(self) -> list[V]:
        evicted: list[V] = []
        for key in list(self._entries):
            if self.used_bytes <= self.capacity_bytes:
                break
            if key not in self._pinned:
                value = self.pop(key)
                assert value is not None
                evicted.append(value)
        return evicted
