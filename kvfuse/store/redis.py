"""The Redis tier: KV cache entries shared by every replica (and every process) through one Redis or Valkey.

One key per entry, `<namespace><cache key>`, whose value carries everything needed to check it (never a
separate metadata key, which Redis could evict on its own: LMCache PR #426 was that bug):

    b"KVFR" | u32 little-endian header length | header (JSON) | positions (int64, T) | K0 V0 K1 V1 ...
    [| residual (T, hidden)]

The value's format is `store.redis_value`'s: a header with checksums, then the positions and each
layer's K and V, as the disk tier keeps them. `open` reads the header and positions with one GETRANGE;
each layer's K and V are then read with one GETRANGE as the loader asks (on its thread, pipelined
behind the recompute) and checked against their checksums before use. A value that is not ours, was
written by another model, is truncated, or vanishes between the lookup and a layer's read (evicted) is
corrupt or missing: the entry is a miss and the request recomputes it.

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

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from kvfuse.kv import KVCache
from kvfuse.store.base import CorruptEntryError, Remote, TierSettings, TierStats, register_tier
from kvfuse.store.keys import CacheKey
from kvfuse.store.redis_value import FIRST_READ, Down, RedisEntry, Refused, encode_entry

log = logging.getLogger(__name__)
T = TypeVar("T")

BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 30.0
DEFAULT_BULK_LIMIT = 512 << 20  # Redis's default proto-max-bulk-len
LOCK_TTL_S = 30.0  # a dead holder frees the build lock after this long
LOCK_WAIT_S = 600.0  # the longest a replica waits for another's build before building itself


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

    def reader(self, key: CacheKey) -> Callable[[int, int], bytes]:
        """Reads bytes [start, end] of the key's value, one GETRANGE through `call` (Down when unavailable)."""
        rkey = self._rkey(key)
        return lambda start, end: self.call(lambda: self._client.getrange(rkey, start, end))

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
            entry = RedisEntry.parse(self.reader(key), key, first, self.model_fp)
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
            cache = RedisEntry.parse(self.reader(key), key, value, self.model_fp).read_all(value)
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
