"""What every storage tier offers, and the registry that builds tiers by name.

A tier maps cache keys to KV caches. `open` returns an entry that can be read one layer at a time
(a `KVCache` as it is, or a lazy entry whose layers are read, and verified, when asked for); a lazy
entry that fails verification mid-read raises `CorruptEntryError`, and the store then calls
`drop_corrupt` on every tier. Adding a tier (issue I's Redis) is one module and one `register_tier`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from kvfuse.kv import KVCache
from kvfuse.loader import LayerSource
from kvfuse.store.keys import CacheKey


class CorruptEntryError(Exception):
    """A stored entry failed verification; `key` says which, when it is known."""

    def __init__(self, message: str, key: CacheKey | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    write_failures: int = 0  # writes that failed (a full disk that eviction could not make room on)
    errors: int = 0  # calls that failed and were answered as misses (a remote tier's timeout or refusal)
    last_write_ok: bool = True  # the tier's health: its last write (a remote tier: its last call) went through


class Tier(Protocol):
    """A storage tier. `corrupt` counts the entries it dropped because they failed verification."""

    name: str
    stats: TierStats
    corrupt: int

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def __contains__(self, key: CacheKey) -> bool: ...
    def get(self, key: CacheKey) -> KVCache | None: ...
    def open(self, key: CacheKey) -> LayerSource | None: ...
    def put(self, key: CacheKey, cache: KVCache, pin: bool = False) -> bool: ...
    def pinned(self) -> set[CacheKey]: ...
    def pin(self, key: CacheKey) -> None: ...
    def unpin(self, key: CacheKey) -> None: ...
    def drop_corrupt(self, key: CacheKey, why: str) -> None: ...


@runtime_checkable
class SharedLocks(Protocol):
    """A tier shared by several processes that can also lock across them (Redis): `exclusive(name)`
    holds a named lock while its block runs, waiting (bounded) for another holder; it yields whether
    the lock is held (False: the tier is unavailable, so the caller goes on alone)."""

    def exclusive(self, name: str) -> AbstractContextManager[bool]: ...


@dataclass(frozen=True, slots=True)
class Remote:
    """Where a shared tier lives: a URL (redis://HOST:PORT/DB, unix:///path), the namespace its keys
    start with (two deployments or models can share one server), and the timeout of every call."""

    url: str
    namespace: str = "kvfuse:"
    timeout_s: float = 0.2


@dataclass(frozen=True, slots=True)
class TierSettings:
    """What a tier factory may need: its byte capacity, the store directory, the model fingerprint and,
    for a shared tier, where it lives."""

    capacity_bytes: int
    root: Path | None = None
    model_fp: str | None = None
    remote: Remote | None = None


# None: not configured (disk without a directory, redis without a URL)
TierFactory = Callable[[TierSettings], "Tier | None"]
TIERS: dict[str, TierFactory] = {}


def register_tier(name: str) -> Callable[[TierFactory], TierFactory]:
    def deco(factory: TierFactory) -> TierFactory:
        TIERS[name] = factory
        return factory

    return deco
