"""The Redis tier: KV cache entries shared by every replica (and every process) through one Redis or Valkey.

One key per entry, `<namespace><cache key>`, whose value carries everything needed to check it (never a
separate metadata key, which Redis could evict on its own: LMCache PR #426 was that bug):

    b"KVFR" | u32 little-endian header length | header (JSON) | positions (int64, T) | K0 V0 K1 V1 ...
    [| residual (T, hidden)]

The header holds the cache format version, the key, the model fingerprint, the dtype, the shape
(layers, kv_heads, T, head_dim) and an xxh3-64 checksum of the positions and of each layer's K and V,
as the disk tier keeps them; an entry with a residual stream (`kv.Residual`) also has `residual`:
its layer, width and checksum. `open` reads the header and positions with one GETRANGE; each layer's K and
V are then read with one GETRANGE as the loader asks (on its thread, pipelined behind the recompute) and
checked against their checksums before use. A value that is not ours, was written by another model,
is truncated, or vanishes between the lookup and a layer's read (evicted) is corrupt or missing: the
entry is a miss and the request recomputes it.

Redis is a cache, never a dependency. Every call has a timeout (`timeout_s`, default 200 ms) and no
retries. A refused connection, a timeout or any other error makes that call a miss, marks the tier down
and starts a backoff (1 s, doubling to 30 s) during which every call is an immediate miss without
touching the network; then one call tries again. So a Redis that is down, hangs or dies mid-request
costs a request at most one timeout per layer already in flight, never more.

Writes are `SET NX`: the first value written for a key stays until Redis evicts it, so replicas that
write one key at once leave one whole, valid value. Entries are never pinned here (kb prefixes stay
pinned in the local tiers); eviction is Redis's own (`maxmemory-policy allkeys-lru` recommended).
Values larger than Redis's `proto-max-bulk-len` are skipped with one warning.

`exclusive(name)` is the build lock across replicas: redis-py's `Lock` (SET NX PX, released by token),
renewed from a thread while its holder runs, so a holder that dies frees it after one TTL.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from kvfuse.kv import KVCache, Residual
from kvfuse.store.base import CorruptEntryError, Remote, TierSettings, TierStats, register_tier
from kvfuse.store.disk import _DTYPES, _digest
from kvfuse.store.keys import CACHE_FORMAT_VERSION, CacheKey, dtype_name

log = logging.getLogger(__name__)
T = TypeVar("T")

MAGIC = b"KVFR"
FIRST_READ = 16 << 10  # the first GETRANGE: the header and, for most entries, the positions
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 30.0
DEFAULT_BULK_LIMIT = 512 << 20  # Redis's default proto-max-bulk-len
LOCK_TTL_S = 30.0  # a dead holder frees the build lock after this long
LOCK_WAIT_S = 600.0  # the longest a replica waits for another's build before building itself
_DTYPE_BY_NAME = {dtype_name(d): d for d in _DTYPES.values()}


class Down(Exception):
    """The call failed or was not made (the tier is in its backoff after an error): a miss."""


class Refused(Down):
    """Redis answered with an error (a command it refuses, out of memory): a miss, but Redis is up."""


class Backoff:
    """Down for 1 s after an error, doubling to 30 s while errors go on; up again after a success."""

    def __init__(self, first_s: float = BACKOFF_FIRST_S, max_s: float = BACKOFF_MAX_S) -> None:
        self.first_s, self.max_s = first_s, max_s
        self._delay = 0.0
        self._until = 0.0

    @property
    def up(self) -> bool:
        return self._delay == 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self._until

    def failed(self) -> None:
        self._delay = min(self.max_s, self._delay * 2 if self._delay else self.first_s)
        self._until = time.monotonic() + self._delay

    def ok(self) -> None:
        self._delay, self._until = 0.0, 0.0


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


class RedisTier:
    """Entries in a shared Redis (see the module docstring). Eviction order: Redis's own
    (`maxmemory-policy`); nothing is pinned here."""

    name = "redis"

    def __init__(self, url: str, model_fp: str | None = None, namespace: str = "kvfuse:", timeout_s: float = 0.2,
                 client: Any = None) -> None:
        self.url, self.model_fp, self.namespace, self.timeout_s = url, model_fp or "", namespace, timeout_s
        self.stats = TierStats()
        self.corrupt = 0  # values dropped because they failed verification (or were not ours)
        self.backoff = Backoff()
        self._client = client if client is not None else connect(url, timeout_s)
        self._bulk_limit: int | None = None
        self._warned_size = False
        self._info: tuple[float, int, int] = (0.0, 0, 0)  # (when read, used bytes, maxmemory)

    # -- every call goes through here --------------------------------------------------------------

    def call(self, fn: Callable[[], T]) -> T:
        """Run one Redis call: raises Down in the backoff, or after an error (which starts it)."""
        import redis

        if not self.backoff.ready():
            raise Down()
        try:
            out = fn()
        except (redis.ResponseError, redis.exceptions.LockError) as e:  # an answer, not an outage: no backoff
            self.stats.errors += 1
            raise Refused(str(e)) from e
        except (redis.RedisError, OSError) as e:
            self.stats.errors += 1
            self.stats.last_write_ok = False
            if self.backoff.up:
                log.warning("Redis tier %s is unreachable (%s: %s); its entries are misses until it answers",
                            _safe_url(self.url), type(e).__name__, e)
            self.backoff.failed()
            raise Down() from e
        if not self.backoff.up:
            log.warning("Redis tier %s answers again", _safe_url(self.url))
        self.backoff.ok()
        self.stats.last_write_ok = True
        return out

    def _rkey(self, key: CacheKey) -> str:
        return f"{self.namespace}{key}"

    # -- reads --------------------------------------------------------------------------------------

    def __contains__(self, key: CacheKey) -> bool:
        try:
            return bool(self.call(lambda: self._client.exists(self._rkey(key))))
        except Down:
            return False

    def open(self, key: CacheKey) -> RedisEntry | None:
        """The entry for per-layer reads (header and positions read and checked), or None: a miss, a
        value that fails its checks (dropped), or Redis unavailable."""
        rkey = self._rkey(key)
        try:
            first = self.call(lambda: self._client.getrange(rkey, 0, FIRST_READ - 1))
            if not first:
                self.stats.misses += 1
                return None
            entry = RedisEntry.parse(self, key, first)
        except Down:
            self.stats.misses += 1
            return None
        except CorruptEntryError as e:
            self.drop_corrupt(key, str(e))
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return entry

    def get(self, key: CacheKey) -> KVCache | None:
        """The whole entry, every layer verified, or None."""
        rkey = self._rkey(key)
        try:
            value = self.call(lambda: self._client.get(rkey))
        except Down:
            self.stats.misses += 1
            return None
        if not value:
            self.stats.misses += 1
            return None
        try:
            cache = RedisEntry.parse(self, key, value).read_all(value)
        except CorruptEntryError as e:
            self.drop_corrupt(key, str(e))
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return cache

    # -- writes -------------------------------------------------------------------------------------

    def put(self, key: CacheKey, cache: KVCache, pin: bool = False) -> bool:
        """SET NX the entry (the first value written stays); False when skipped, refused or Redis is down."""
        value = encode_entry(key, cache, self.model_fp)
        if len(value) > self.bulk_limit():
            if not self._warned_size:
                log.warning("KV cache entry of %d bytes is larger than Redis's proto-max-bulk-len (%d): not "
                            "stored in Redis (raise proto-max-bulk-len to share entries this large)",
                            len(value), self.bulk_limit())
                self._warned_size = True
            self.stats.write_failures += 1
            return False
        try:
            self.call(lambda: self._client.set(self._rkey(key), value, nx=True))
        except Down:
            self.stats.write_failures += 1
            return False
        return True

    def bulk_limit(self) -> int:
        """Redis's largest value (`proto-max-bulk-len`), read once; the default where CONFIG is refused."""
        if self._bulk_limit is None:
            try:
                got = self.call(lambda: self._client.config_get("proto-max-bulk-len"))
                self._bulk_limit = int(got.get("proto-max-bulk-len", DEFAULT_BULK_LIMIT))
            except Refused:  # CONFIG disabled (a managed Redis): assume the default
                self.stats.errors -= 1
                self._bulk_limit = DEFAULT_BULK_LIMIT
            except Down:
                return DEFAULT_BULK_LIMIT  # read it again once Redis answers
        return self._bulk_limit

    def drop_corrupt(self, key: CacheKey, why: str) -> None:
        log.warning("dropping corrupt KV cache entry %s from Redis: %s", key[:12], why)
        self.corrupt += 1
        self.delete(key)

    def delete(self, key: CacheKey) -> None:
        try:
            self.call(lambda: self._client.delete(self._rkey(key)))
        except Down:
            pass

    # Redis entries are never pinned: a replica that misses a kb prefix's block rebuilds or reads it elsewhere.
    def pinned(self) -> set[CacheKey]:
        return set()

    def pin(self, key: CacheKey) -> None:
        pass

    def unpin(self, key: CacheKey) -> None:
        pass

    # -- sizes (read at most every 5 s, for /metrics) -------------------------------------------------

    def _memory(self) -> tuple[int, int]:
        when, used, cap = self._info
        if time.monotonic() - when > 5.0:
            try:
                info = self.call(lambda: self._client.info("memory"))
                used, cap = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
            except Down:  # unavailable, or INFO disabled
                pass
            self._info = (time.monotonic(), used, cap)
        return used, cap

    @property
    def used_bytes(self) -> int:
        return self._memory()[0]

    @property
    def capacity_bytes(self) -> int:
        """Redis's maxmemory (0: no limit set)."""
        return self._memory()[1]

    # -- the build lock across replicas ---------------------------------------------------------------

    @contextmanager
    def exclusive(self, name: str, ttl_s: float = LOCK_TTL_S, wait_s: float = LOCK_WAIT_S) -> Iterator[bool]:
        """Hold the lock `name` across every process of this Redis, waiting up to wait_s for its holder;
        yields whether it is held (False: Redis is unavailable or the wait ran out, so the caller goes
        on alone). The lock is renewed while held, so only a holder that dies lets it expire."""
        lock = self._client.lock(f"{self.namespace}lock:{name}", timeout=ttl_s, sleep=0.05, thread_local=False)
        try:
            held = bool(self.call(lambda: lock.acquire(blocking=True, blocking_timeout=wait_s)))
        except Down:
            held = False
        if not held:
            log.warning("build lock %s not taken (Redis unavailable, or still held after %.0f s): building here",
                        name[:40], wait_s)
            yield False
            return
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(ttl_s / 3):
                try:
                    self.call(lock.reacquire)
                except Refused:  # lost it (expired while Redis was away): nothing to renew
                    return
                except Down:
                    pass

        keeper = threading.Thread(target=renew, name="kvfuse-lock-renew", daemon=True)
        keeper.start()
        try:
            yield True
        finally:
            stop.set()
            keeper.join()
            try:
                self.call(lock.release)
            except Exception:  # expired or Redis away: it frees itself after its TTL
                pass


class RedisEntry:
    """An opened Redis entry: header and positions checked; layers read (one GETRANGE each) and
    checksum-verified as they are asked for."""

    def __init__(self, tier: RedisTier, key: CacheKey, header: dict[str, Any], data_start: int,
                 positions: torch.Tensor) -> None:
        self.tier, self.key = tier, key
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
    def parse(cls, tier: RedisTier, key: CacheKey, first: bytes) -> RedisEntry:
        """Check the value's head (`first`: its first bytes, or all of it) against the key and model."""
        name = key[:12]
        if first[:4] != MAGIC or len(first) < 8:
            raise CorruptEntryError(f"{name}: not a kvfuse cache entry", key)
        (n,) = struct.unpack("<I", first[4:8])
        if n > FIRST_READ * 64:
            raise CorruptEntryError(f"{name}: header length {n} is implausible", key)
        head = first[8 : 8 + n] if len(first) >= 8 + n else tier.call(
            lambda: tier._client.getrange(tier._rkey(key), 8, 8 + n - 1))
        try:
            header = json.loads(head)
            layers, heads, tokens, dim = (int(x) for x in header["shape"])
            dtype = header["dtype"]
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptEntryError(f"{name}: unreadable header ({e})", key) from e
        if header.get("format") != CACHE_FORMAT_VERSION or header.get("key") != key:
            raise CorruptEntryError(f"{name}: holds entry {str(header.get('key', '?'))[:12]} (format "
                                    f"{header.get('format')}), not this key", key)
        if tier.model_fp and header.get("model") != tier.model_fp:
            raise CorruptEntryError(f"{name}: written by a different model", key)
        if dtype not in _DTYPE_BY_NAME or len(header.get("xxh3_k", ())) != layers \
                or len(header.get("xxh3_v", ())) != layers:
            raise CorruptEntryError(f"{name}: header does not match its shape", key)
        residual = header.get("residual")
        if residual is not None and not (isinstance(residual, dict) and {"layer", "width", "xxh3"} <= residual.keys()):
            raise CorruptEntryError(f"{name}: unreadable residual in its header", key)
        start = 8 + n
        end = start + tokens * 8
        raw = first[start:end] if len(first) >= end else tier.call(
            lambda: tier._client.getrange(tier._rkey(key), start, end - 1))
        if len(raw) != tokens * 8:
            raise CorruptEntryError(f"{name}: truncated (positions)", key)
        positions = torch.frombuffer(bytearray(raw), dtype=torch.int64) if tokens else torch.empty(0, dtype=torch.int64)
        if _digest(positions) != header.get("xxh3_positions"):
            raise CorruptEntryError(f"{name}: checksum mismatch on positions", key)
        del heads, dim
        return cls(tier, key, header, end, positions)

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
        rkey = self.tier._rkey(self.key)
        try:
            raw = self.tier.call(lambda: self.tier._client.getrange(rkey, start, end - 1))
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
        rkey = self.tier._rkey(self.key)
        try:
            raw = self.tier.call(lambda: self.tier._client.getrange(rkey, start, end - 1))
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


def connect(url: str, timeout_s: float) -> Any:
    """A client with the timeout on every socket operation and no retries (a miss is cheaper than a wait)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0)


def _safe_url(url: str) -> str:
    """The URL without its password, for logs."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@")
    return url


def check_url(url: str) -> str:
    """The URL if its scheme is one Redis takes, else a ValueError that says what to write."""
    from urllib.parse import urlsplit

    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"--redis {url!r}: write redis://HOST:PORT/DB, rediss://… (TLS) or unix:///path/to.sock")
    return url


@register_tier("redis")
def _redis(settings: TierSettings) -> RedisTier | None:
    remote: Remote | None = settings.remote
    if remote is None:
        return None
    return RedisTier(check_url(remote.url), settings.model_fp, remote.namespace, remote.timeout_s)


__all__ = ["RedisTier", "RedisEntry", "Backoff", "Down", "Refused", "encode_entry", "check_url", "connect"]
