"""The disk tier: one safetensors file per entry, written atomically, verified on every read.

File `<root>/<key[:2]>/<key>.safetensors` holds tensors `k`, `v` (layers, kv_heads, T, head_dim) and
`positions` (T,), and string metadata: the cache format version, the key, the model fingerprint, the
dtype and an xxh3-64 checksum per layer of K and of V. A chunk entry may also hold `residual` (T, hidden)
with its layer and checksum in the metadata (`residual_layer`, `xxh3_residual`; `kv.Residual`). A read
checks the metadata against the file name and the expected model, and each layer's checksum as that
layer is read, so a flipped byte, a truncated file, a file renamed to another key or one written by
another model is detected, dropped and counted as corrupt, never used. Reads can be per layer
(safetensors reads a single slice), which is what pipelined loading uses. The index is rebuilt from the
directory at start, from file headers only.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from kvfuse.kv import KVCache, Residual
from kvfuse.mapped import map_safetensors
from kvfuse.store.base import CorruptEntryError, TierSettings, TierStats, register_tier
from kvfuse.store.keys import CACHE_FORMAT_VERSION, CacheKey, dtype_name
from kvfuse.store.lru import LruIndex

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"


@dataclass(frozen=True, slots=True)
class EntryInfo:
    key: CacheKey
    path: Path
    nbytes: int
    tokens: int
    layers: int


def _digest(t: torch.Tensor) -> str:
    """xxh3-64 of a tensor's bytes, read in place (3x faster than zlib's CRC32 here, GIL released)."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(t.contiguous().view(torch.uint8).numpy().data) if t.numel() else ""


class DiskTier:
    """Entries on disk with LRU eviction by file bytes. Eviction order: least recently read or written
    first (access time kept in the index and mirrored in file mtimes, so it survives a restart);
    pinned entries are never evicted."""

    name = "disk"

    def __init__(self, root: str | Path, capacity_bytes: int = 20 << 30, model_fp: str | None = None) -> None:
        self.root = Path(root)
        self.model_fp = model_fp
        self.stats = TierStats()
        self.corrupt = 0  # entries found corrupt and dropped, at the start-up scan or on a read
        self._index: LruIndex[EntryInfo] = LruIndex(capacity_bytes)
        self._lock = threading.RLock()
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    # -- index ---------------------------------------------------------------------------------

    def _path(self, key: CacheKey) -> Path:
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def _scan(self) -> None:
        """Rebuild the index from the files on disk, oldest access first; drop stale temp files."""
        found = []
        for path in self.root.glob(f"*/*{SUFFIX}"):
            try:
                st = path.stat()
                info = self._read_info(path)
            except (OSError, CorruptEntryError, ValueError) as e:
                log.warning("dropping unreadable KV cache file %s: %s", path.name, e)
                self.corrupt += 1
                self._drop_file(path)
                continue
            found.append((st.st_mtime_ns, info))
        for tmp in self.root.glob("*/.tmp-*"):
            if time.time() - tmp.stat().st_mtime > 3600:  # a writer that died long ago
                tmp.unlink(missing_ok=True)
        for _, info in sorted(found, key=lambda x: x[0]):
            self._index.add(info.key, info, info.nbytes, evict=False)
        self._drop_evicted(self._index.evict())  # a budget lowered since the last run

    def _read_info(self, path: Path) -> EntryInfo:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                shape = f.get_slice("k").get_shape()
        except Exception as e:  # the safetensors header could not be parsed
            raise CorruptEntryError(f"{path}: unreadable header ({e})") from e
        key = meta.get("key", "")
        if meta.get("format") != str(CACHE_FORMAT_VERSION) or path.name != f"{key}{SUFFIX}":
            raise CorruptEntryError(f"{path}: metadata does not match the file name or format")
        return EntryInfo(cast(CacheKey, key), path, path.stat().st_size, int(shape[2]), int(shape[0]))

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[CacheKey]:
        return self._index.keys()

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def info(self, key: CacheKey) -> EntryInfo | None:
        return self._index.get(key)

    # -- reads ---------------------------------------------------------------------------------

    def open(self, key: CacheKey) -> DiskEntry | None:
        """Open an entry for per-layer reads, or None on a miss or a corrupt entry."""
        with self._lock:
            info = self._index.get(key)
            if info is None:
                self.stats.misses += 1
                return None
            try:
                entry = DiskEntry(self, info)
            except CorruptEntryError as e:
                self._corrupt(key, str(e))
                return None
            self._touch(key)
            self.stats.hits += 1
            return entry

    def get(self, key: CacheKey) -> KVCache | None:
        """Read and verify a whole entry, or None on a miss or a corrupt entry."""
        entry = self.open(key)
        if entry is None:
            return None
        try:
            return entry.read_all()
        except CorruptEntryError as e:
            self._corrupt(key, str(e))
            self.stats.hits -= 1
            self.stats.misses += 1
            return None

    def _touch(self, key: CacheKey) -> None:
        self._index.touch(key)
        try:
            os.utime(self._path(key))
        except OSError:
            pass

    def _corrupt(self, key: CacheKey, why: str) -> None:
        log.warning("dropping corrupt KV cache entry %s: %s", key[:12], why)
        with self._lock:
            self.corrupt += 1
            info = self._index.pop(key)
            if info is not None:
                self._drop_file(info.path)

    def drop_corrupt(self, key: CacheKey, why: str) -> None:
        self._corrupt(key, why)

    @staticmethod
    def _drop_file(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass

    # -- writes --------------------------------------------------------------------------------

    def put(self, key: CacheKey, cache: KVCache, pin: bool = False) -> bool:
        """Write an entry atomically. Returns False if it was not stored: larger than the budget, or the
        filesystem is full (ENOSPC) even after evicting every unpinned entry, least recently used first
        (logged and counted in `stats.write_failures`; requests go on)."""
        from safetensors.torch import save

        k, v = cache.k.contiguous(), cache.v.contiguous()
        meta = {
            "format": str(CACHE_FORMAT_VERSION),
            "key": str(key),
            "model": self.model_fp or "",
            "dtype": dtype_name(k.dtype),
            "xxh3_k": json.dumps([_digest(k[i]) for i in range(k.shape[0])]),
            "xxh3_v": json.dumps([_digest(v[i]) for i in range(v.shape[0])]),
        }
        tensors = {"k": k, "v": v, "positions": cache.positions.contiguous()}
        if cache.residual is not None:
            tensors["residual"] = cache.residual.hidden.contiguous()
            meta["residual_layer"] = str(cache.residual.layer)
            meta["xxh3_residual"] = _digest(tensors["residual"])
        data = save(tensors, metadata=meta)
        if len(data) > self.capacity_bytes:
            return False
        path = self._path(key)
        while True:
            try:
                self._write(path, data)
                break
            except OSError as e:
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                if full and self._evict_one(key):  # the filesystem filled before the budget: make room, LRU first
                    continue
                self.stats.write_failures += 1
                self.stats.last_write_ok = False
                if not full:
                    raise
                log.warning("disk tier %s is full and nothing more can be evicted; KV cache entry not "
                            "written (requests go on)", self.root)
                return False
        with self._lock:
            info = EntryInfo(key, path, len(data), len(cache), int(k.shape[0]))
            self._drop_evicted(self._index.add(key, info, info.nbytes, pin))
        self.stats.last_write_ok = True
        return True

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        """Write a file atomically: a temp file, fsync, rename (readers see the old file or the new one)."""
        tmp = path.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _evict_one(self, keep: CacheKey) -> bool:
        """Evict the least recently used unpinned entry (not `keep`); False when there is none."""
        with self._lock:
            victim = self._index.oldest_unpinned(exclude=keep)
            if victim is None:
                return False
            info = self._index.pop(victim)
            assert info is not None
            self._drop_evicted([info])
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
            self._drop_evicted(self._index.unpin(key))

    def delete(self, key: CacheKey) -> None:
        with self._lock:
            info = self._index.pop(key)
            if info is not None:
                self._drop_file(info.path)

    def clear(self) -> int:
        with self._lock:
            n = len(self._index)
            for key in self._index.keys():
                self.delete(key)
            return n

    def _drop_evicted(self, evicted: list[EntryInfo]) -> None:
        for info in evicted:
            self._drop_file(info.path)
            self.stats.evictions += 1

    def verify(self, repair: bool = False) -> Iterator[tuple[CacheKey, str | None]]:
        """Check every entry fully; yields (key, error or None), and drops the corrupt ones where `repair`
        (else they stay for a look, and the next read drops them)."""
        for key in self.keys():
            with self._lock:
                info = self._index.get(key)
            if info is None:
                continue
            try:
                DiskEntry(self, info).read_all()
                yield key, None
            except CorruptEntryError as e:
                if repair:
                    self._corrupt(key, str(e))
                yield key, str(e)


class DiskEntry:
    """An open entry: metadata verified, layers read (and checksum-verified) one at a time.

    The file is memory-mapped and each layer is a view into the mapping: safetensors' Python API copies
    every slice it reads, and on a CPU that copy is most of the load, competing with the recompute.
    safetensors still parses and checks the header (it refuses a file shorter than its header says);
    the tensor offsets come from that same header. Writers only ever replace files by rename, so a
    mapped file is never truncated under a reader."""

    def __init__(self, tier: DiskTier, info: EntryInfo) -> None:
        from safetensors import safe_open

        self.info = info
        name = info.path.name
        try:
            with safe_open(str(info.path), framework="pt") as f:
                meta = f.metadata() or {}
            if meta.get("key") != info.key:
                raise CorruptEntryError(f"{name}: holds entry {meta.get('key', '?')[:12]}, not this key")
            if tier.model_fp and meta.get("model") != tier.model_fp:
                raise CorruptEntryError(f"{name}: written by a different model")
            self._sum_k = json.loads(meta["xxh3_k"])
            self._sum_v = json.loads(meta["xxh3_v"])
            tensors = _map_tensors(info.path)
            self.positions: torch.Tensor = tensors["positions"].clone()
            self._k, self._v = tensors["k"], tensors["v"]
            self._residual = tensors.get("residual")
            self._residual_layer = int(meta["residual_layer"]) if self._residual is not None else None
            self._sum_residual = meta.get("xxh3_residual", "")
        except CorruptEntryError:
            raise
        except Exception as e:
            raise CorruptEntryError(f"{name}: {e}") from e
        if len(self._sum_k) != self._k.shape[0] or self.positions.shape[0] != self._k.shape[2] or (
                self._residual is not None and self._residual.shape[0] != self._k.shape[2]):
            raise CorruptEntryError(f"{name}: shapes do not match its metadata")
        self.layers = int(self._k.shape[0])

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i, (kv_heads, T, head_dim) each, checksum-verified, as views of the file."""
        k, v = self._k[i], self._v[i]
        if _digest(k) != self._sum_k[i] or _digest(v) != self._sum_v[i]:
            raise CorruptEntryError(f"{self.info.path.name}: checksum mismatch on layer {i}", self.info.key)
        return k, v

    def residual_at(self, layer: int) -> torch.Tensor | None:
        """(T, hidden) the tokens' input to that layer if the entry holds it, checksum-verified, as a view."""
        if self._residual is None or self._residual_layer != layer:
            return None
        if _digest(self._residual) != self._sum_residual:
            raise CorruptEntryError(f"{self.info.path.name}: checksum mismatch on the residual", self.info.key)
        return self._residual

    def read_all(self) -> KVCache:
        ks, vs = zip(*(self.layer(i) for i in range(self.layers)), strict=True)
        return KVCache(torch.stack(ks), torch.stack(vs), self.positions,
                       Residual.read(self.residual_at, self._residual_layer))


def _map_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Read-only tensor views of a safetensors file, mapped into memory (no copy: `mapped`)."""
    try:
        return map_safetensors(path)[0]
    except ValueError as e:
        raise CorruptEntryError(str(e)) from None


@register_tier("disk")
def _disk(settings: TierSettings) -> DiskTier | None:
    return DiskTier(settings.root, settings.capacity_bytes, settings.model_fp) if settings.root is not None else None
