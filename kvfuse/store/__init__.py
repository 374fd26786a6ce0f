"""KV cache storage: content-addressed keys and tiers (issue A ships the memory tier)."""

from kvfuse.store.keys import BlockHash, CacheKey, ChunkKey, chunk_key, hash_block_tokens, prefix_block_hashes
from kvfuse.store.memory import MemoryTier

__all__ = [
    "BlockHash",
    "CacheKey",
    "ChunkKey",
    "MemoryTier",
    "chunk_key",
    "hash_block_tokens",
    "prefix_block_hashes",
]
