"""Content-addressed cache keys: pure functions, no state.

A chunk's key covers everything its KV depends on: the cache format, the model (config and weights),
the storage dtype, the preamble it was computed behind, and its own token ids. A prefix is cut into
fixed-size blocks whose hashes are chained (vLLM's `hash_block_tokens`): a block's hash covers its
parent's hash, its tokens and extra keys (a tenant salt, say), so equal hashes mean equal prefixes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import NewType

import torch

CACHE_FORMAT_VERSION = 2  # 2: xxh3-64 layer checksums

BlockHash = NewType("BlockHash", str)
ChunkKey = NewType("ChunkKey", str)
CacheKey = BlockHash | ChunkKey


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def chunk_key(model_fp: str, dtype: torch.dtype, preamble: Sequence[int], tokens: Sequence[int]) -> ChunkKey:
    return ChunkKey(_digest("chunk", CACHE_FORMAT_VERSION, model_fp, dtype_name(dtype), list(preamble), list(tokens)))


def root_hash(model_fp: str, dtype: torch.dtype) -> BlockHash:
    """The parent of a prefix's first block: ties every chain to one model and dtype."""
    return BlockHash(_digest("prefix-root", CACHE_FORMAT_VERSION, model_fp, dtype_name(dtype)))


def hash_block_tokens(parent: BlockHash, tokens: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    return BlockHash(_digest(parent, list(tokens), list(extra_keys)))


def prefix_block_hashes(
    root: BlockHash, tokens: Sequence[int], block_size: int, extra_keys: Sequence[str] = ()
) -> list[BlockHash]:
    """Chained hashes of the full blocks of tokens (a trailing partial block is not cacheable)."""
    hashes: list[BlockHash] = []
    parent = root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tokens[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
