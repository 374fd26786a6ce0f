"""KV cache storage: content-addressed keys, a memory tier, a disk tier, a shared Redis tier, and the
tiered store."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kvfuse.defaults import DEFAULT_CAPACITY
from kvfuse.store.base import TIERS, CorruptEntryError, Remote, SharedLocks, Tier, TierSettings, register_tier
from kvfuse.store.disk import DiskTier
from kvfuse.store.keys import BlockHash, CacheKey, ChunkKey, chunk_key, hash_block_tokens, prefix_block_hashes
from kvfuse.store.memory import MemoryTier
from kvfuse.store.redis import RedisTier
from kvfuse.store.tiered import Opened, StoreStats, TieredStore

DEFAULT_TIERS = ("memory", "disk", "redis")  # a tier whose settings are missing is left out


def open_store(
    root: str | Path | None,
    model_fp: str | None,
    tiers: Sequence[str] = DEFAULT_TIERS,
    capacity: Mapping[str, int] | None = None,
    remote: Remote | None = None,
) -> TieredStore:
    """The named tiers, in order, from the TIERS registry; a tier that needs a directory is left out
    when root is None, and one that needs a server (redis) when remote is None."""
    caps = {**DEFAULT_CAPACITY, **(capacity or {})}
    built = []
    for name in tiers:
        if name not in TIERS:
            raise ValueError(f"unknown store tier {name!r}; known: {', '.join(sorted(TIERS))}")
        tier = TIERS[name](TierSettings(caps.get(name, DEFAULT_CAPACITY["disk"]),
                                        Path(root) if root is not None else None, model_fp, remote))
        if tier is not None:
            built.append(tier)
    return TieredStore(built)


__all__ = [
    "TIERS",
    "BlockHash",
    "CorruptEntryError",
    "Opened",
    "RedisTier",
    "Remote",
    "SharedLocks",
    "TierSettings",
    "register_tier",
    "CacheKey",
    "ChunkKey",
    "DiskTier",
    "MemoryTier",
    "StoreStats",
    "Tier",
    "TieredStore",
    "chunk_key",
    "hash_block_tokens",
    "open_store",
    "prefix_block_hashes",
]
