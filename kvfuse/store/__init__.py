"""KV cache storage: content-addressed keys, a memory tier, a disk tier, and the tiered store."""

from __future__ import annotations

from pathlib import Path

from kvfuse.store.disk import DiskTier
from kvfuse.store.keys import BlockHash, CacheKey, ChunkKey, chunk_key, hash_block_tokens, prefix_block_hashes
from kvfuse.store.memory import MemoryTier
from kvfuse.store.tiered import StoreStats, Tier, TieredStore

DEFAULT_MEMORY_BYTES = 4 << 30
DEFAULT_DISK_BYTES = 20 << 30


def open_store(
    root: str | Path | None,
    model_fp: str | None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    disk_bytes: int = DEFAULT_DISK_BYTES,
) -> TieredStore:
    """A memory tier, over a disk tier at root when one is given."""
    disk = DiskTier(root, disk_bytes, model_fp) if root is not None else None
    return TieredStore(MemoryTier(memory_bytes), disk)


__all__ = [
    "BlockHash",
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
