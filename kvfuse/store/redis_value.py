"""One Redis entry's value, the format the Redis tier (`store.redis`) writes and reads:

    b"KVFR" | u32 little-endian header length | header (JSON) | positions (int64, T) | K0 V0 K1 V1 ...
    [| residual (T, hidden)]

The header holds the cache format version, the key, the model fingerprint, the dtype, the shape
(layers, kv_heads, T, head_dim) and an xxh3-64 checksum of the positions and of each layer's K and V,
as the disk tier keeps them; an entry with a residual stream (`kv.Residual`) also has `residual`: its
layer, width and checksum. `RedisEntry.parse` checks the header and positions; each layer's K and V
are then read (through a range reader, one GETRANGE each) and checked as they are asked for. Nothing
here talks to Redis: the tier hands in the reader, which raises `Down` when Redis is unavailable.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import torch

from kvfuse.kv import KVCache, Residual
from kvfuse.mapped import DTYPES
from kvfuse.store.base import CorruptEntryError
from kvfuse.store.disk import _digest
from kvfuse.store.keys import CACHE_FORMAT_VERSION, CacheKey, dtype_name

MAGIC = b"KVFR"
FIRST_READ = 16 << 10  # the first GETRANGE: the header and, for most entries, the positions
_DTYPE_BY_NAME = {dtype_name(d): d for d in DTYPES.values()}
RangeReader = Callable[[int, int], bytes]  # (start, end inclusive) -> those bytes of the value


class Down(Exception):
    """The call failed or was not made (the tier is in its backoff after an error): a miss."""


class Refused(Down):
    """Redis answered with an error (a command it refuses, out of memory): a miss, but Redis is up."""


def encode_entry(key: CacheKey, cache: KVCache, model_fp: str) -> bytes:
    """The value stored for an entry (see the module docstring)."""
    k, v = cache.k.contiguous(), cache.v.contiguous()
    pos = cache.positions.to(torch.int64).contiguous()
    header = {
        "format": CACHE_FORMAT_VERSION, "key": str(key), "model": model_fp, "dtype": dtype_name(k.dtype),
        "shape": list(k.shape), "xxh3_positions": _digest(pos),
        "xxh3_k": [_digest(k[i]) for i in range(k.shape[0])], "xxh3_v": [_digest(v[i]) for i in range(v.shape[0])],
    }
    r = cache.residual
    hidden = r.hidden.to(k.dtype).contiguous() if r is not None else None
    if r is not None and hidden is not None:
        header["residual"] = {"layer": r.layer, "width": int(hidden.shape[1]), "xxh3": _digest(hidden)}
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [MAGIC, struct.pack("<I", len(head)), head, _bytes(pos)]
    for i in range(k.shape[0]):
        parts += [_bytes(k[i]), _bytes(v[i])]
    if hidden is not None:
        parts.append(_bytes(hidden))
    return b"".join(parts)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


class RedisEntry:
    """An opened Redis entry: header and positions checked; layers read (one GETRANGE each) and
    checksum-verified as they are asked for."""

    def __init__(self, read: RangeReader, key: CacheKey, header: dict[str, Any], data_start: int,
                 positions: torch.Tensor) -> None:
        self.read, self.key = read, key
        self.layers, heads, self.tokens, dim = (int(x) for x in header["shape"])
        self.dtype = _DTYPE_BY_NAME[header["dtype"]]
        self._shape = (heads, self.tokens, dim)
        self._layer_bytes = heads * self.tokens * dim * self.dtype.itemsize
        self._start = data_start
        self._sum_k, self._sum_v = header["xxh3_k"], header["xxh3_v"]
        self.positions = positions
        r = header.get("residual")
        self._residual: tuple[int, int, str] | None = (int(r["layer"]), int(r["width"]), str(r["xxh3"])) if r else None

    @classmethod
    def parse(cls, read: RangeReader, key: CacheKey, first: bytes, model_fp: str) -> RedisEntry:
        """Check the value's head (`first`: its first bytes, or all of it) against the key and the model
        (`model_fp`; "" checks none); `read(start, end)` reads more of the value, end inclusive."""
        name = key[:12]
        if first[:4] != MAGIC or len(first) < 8:
            raise CorruptEntryError(f"{name}: not a kvfuse cache entry", key)
        (n,) = struct.unpack("<I", first[4:8])
        if n > FIRST_READ * 64:
            raise CorruptEntryError(f"{name}: header length {n} is implausible", key)
        head = first[8 : 8 + n] if len(first) >= 8 + n else read(8, 8 + n - 1)
        try:
            header = json.loads(head)
            layers, heads, tokens, dim = (int(x) for x in header["shape"])
            dtype = header["dtype"]
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptEntryError(f"{name}: unreadable header ({e})", key) from e
        if header.get("format") != CACHE_FORMAT_VERSION or header.get("key") != key:
            raise CorruptEntryError(f"{name}: holds entry {str(header.get('key', '?'))[:12]} (format "
                                    f"{header.get('format')}), not this key", key)
        if model_fp and header.get("model") != model_fp:
            raise CorruptEntryError(f"{name}: written by a different model", key)
        if dtype not in _DTYPE_BY_NAME or len(header.get("xxh3_k", ())) != layers \
                or len(header.get("xxh3_v", ())) != layers:
            raise CorruptEntryError(f"{name}: header does not match its shape", key)
        residual = header.get("residual")
        if residual is not None and not (isinstance(residual, dict) and {"layer", "width", "xxh3"} <= residual.keys()):
            raise CorruptEntryError(f"{name}: unreadable residual in its header", key)
        start = 8 + n
        end = start + tokens * 8
        raw = first[start:end] if len(first) >= end else read(start, end - 1)
        if len(raw) != tokens * 8:
            raise CorruptEntryError(f"{name}: truncated (positions)", key)
        positions = torch.frombuffer(bytearray(raw), dtype=torch.int64) if tokens else torch.empty(0, dtype=torch.int64)
        if _digest(positions) != header.get("xxh3_positions"):
            raise CorruptEntryError(f"{name}: checksum mismatch on positions", key)
        del heads, dim
        return cls(read, key, header, end, positions)

    def __len__(self) -> int:
        return self.tokens

    @property
    def nbytes(self) -> int:
        return 2 * self.layers * self._layer_bytes + self._residual_bytes

    @property
    def _residual_bytes(self) -> int:
        return self.tokens * self._residual[1] * self.dtype.itemsize if self._residual else 0

    def _residual_span(self) -> tuple[int, int]:
        start = self._start + 2 * self.layers * self._layer_bytes
        return start, start + self._residual_bytes

    def _span(self, i: int) -> tuple[int, int]:
        start = self._start + 2 * i * self._layer_bytes
        return start, start + 2 * self._layer_bytes

    def _split(self, i: int, raw: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        if len(raw) != 2 * self._layer_bytes:
            raise CorruptEntryError(f"{self.key[:12]}: truncated or gone (layer {i})", self.key)
        if not raw:  # an entry of no tokens
            empty = torch.empty(self._shape, dtype=self.dtype)
            return empty, empty.clone()
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        k = buf[: self._layer_bytes].view(self.dtype).view(self._shape)
        v = buf[self._layer_bytes :].view(self.dtype).view(self._shape)
        if _digest(k) != self._sum_k[i] or _digest(v) != self._sum_v[i]:
            raise CorruptEntryError(f"{self.key[:12]}: checksum mismatch on layer {i}", self.key)
        return k, v

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i, (kv_heads, T, head_dim) each, read now and verified. Redis unavailable or
        the value gone mid-read: CorruptEntryError, so the request recomputes the chunk."""
        start, end = self._span(i)
        try:
            raw = self.read(start, end - 1)
        except Down:
            raise CorruptEntryError(f"{self.key[:12]}: Redis became unavailable mid-read", self.key) from None
        return self._split(i, raw)

    def _hidden(self, raw: bytes) -> torch.Tensor:
        assert self._residual is not None
        if len(raw) != self._residual_bytes:
            raise CorruptEntryError(f"{self.key[:12]}: truncated or gone (residual)", self.key)
        hidden = torch.frombuffer(bytearray(raw), dtype=self.dtype).view(self.tokens, self._residual[1]) if raw \
            else torch.empty(0, self._residual[1], dtype=self.dtype)
        if _digest(hidden) != self._residual[2]:
            raise CorruptEntryError(f"{self.key[:12]}: checksum mismatch on the residual", self.key)
        return hidden

    def residual_at(self, layer: int) -> torch.Tensor | None:
        """(T, hidden) the tokens' input to that layer if the entry holds it, read now (one GETRANGE) and
        verified; Redis unavailable mid-read: CorruptEntryError, as for a layer."""
        if self._residual is None or self._residual[0] != layer:
            return None
        start, end = self._residual_span()
        try:
            raw = self.read(start, end - 1)
        except Down:
            raise CorruptEntryError(f"{self.key[:12]}: Redis became unavailable mid-read", self.key) from None
        return self._hidden(raw)

    def read_all(self, value: bytes) -> KVCache:
        """Every layer (and the residual, if any) from the whole value, verified."""
        expected = self._residual_span()[1]
        if len(value) != expected:
            raise CorruptEntryError(f"{self.key[:12]}: truncated or padded", self.key)
        ks, vs = zip(*(self._split(i, value[slice(*self._span(i))]) for i in range(self.layers)), strict=True)
        residual = Residual(self._residual[0], self._hidden(value[slice(*self._residual_span())])) \
            if self._residual else None
        return KVCache(torch.stack(ks), torch.stack(vs), self.positions, residual)
