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
from dataclasses import dataclass
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


def chunk_key(
    model_fp: str, dtype: torch.dtype, preamble: Sequence[int], tokens: Sequence[int], salt: str = "",
    residual: int | None = None,
) -> ChunkKey:
    """`residual`: the entry also holds the tokens' residual stream at that layer (`kv.Residual`)."""
    parts: list[object] = ["chunk", CACHE_FORMAT_VERSION, model_fp, dtype_name(dtype), list(preamble), list(tokens)]
    if salt:  # unsalted keys stay as they were, so caches stored before salts existed are still found
        parts.append(salt)
    if residual is not None:  # likewise: keys without a residual are unchanged
        parts.append(["residual", residual])
    return ChunkKey(_digest(*parts))


def root_hash(model_fp: str, dtype: torch.dtype) -> BlockHash:
    """The parent of a prefix's first block: ties every chain to one model and dtype."""
    return BlockHash(_digest("prefix-root", CACHE_FORMAT_VERSION, model_fp, dtype_name(dtype)))


def hash_block_tokens(parent: BlockHash, tokens: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    return BlockHash(_digest(parent, list(tokens), list(extra_keys)))


@dataclass(frozen=True, slots=True)
class SaltRange:
    """An extra key for the prefix blocks that overlap tokens [start, end) (`request.Salt.key` renders it)."""

    start: int
    end: int
    key: str


def block_extra_keys(salts: Sequence[SaltRange], start: int, end: int) -> list[str]:
    """The keys of the salts overlapping [start, end), sorted and without repeats."""
    return sorted({s.key for s in salts if s.start < end and start < s.end})


def tail_block_hash(parent: BlockHash, tokens: Sequence[int], block_size: int, salts: Sequence[SaltRange] = ()
                    ) -> BlockHash | None:
    """The key of tokens' trailing partial block (fewer than block_size tokens), chained after their last
    full block (`parent`: its hash, or the root when there is none); None when tokens end on a block
    boundary. The hash covers the partial block's tokens, so it never equals a full block's key: a
    longer prefix that fills the block keys it as a full block, and finds no tail entry."""
    start = len(tokens) // block_size * block_size
    if start == len(tokens):
        return None
    return hash_block_tokens(parent, tokens[start:], block_extra_keys(salts, start, len(tokens)) if salts else ())


def prefix_block_hashes(
    root: BlockHash, tokens: Sequence[int], block_size: int, extra_keys: Sequence[str] = (),
    salts: Sequence[SaltRange] = (),
) -> list[BlockHash]:
    """Chained hashes of the full blocks of tokens (a trailing partial block has its own key:
    `tail_block_hash`).

    Every block gets extra_keys, plus the keys of the salts whose range it overlaps (per-range salts:
    a tenant's private documents are salted, shared ones are not). Because hashes chain, a block after
    a salted one is as private as it is."""
    hashes: list[BlockHash] = []
    parent = root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        end = start + block_size
        keys = list(extra_keys) + block_extra_keys(salts, start, end) if salts else extra_keys
        parent = hash_block_tokens(parent, tokens[start:end], keys)
        hashes.append(parent)
    return hashes
