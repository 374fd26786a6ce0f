"""The Redis tier: its value format and checks on fakeredis (fast), and on a real redis-server (slow):
entries shared between processes, every kind of bad value recomputed, a Redis that dies or hangs,
writers racing on one key, and the build lock across replicas."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from kbdata import write_kb

from kvfuse.engine import Engine
from kvfuse.kv import KVCache
from kvfuse.request import Request
from kvfuse.store import RedisTier, Remote, open_store
from kvfuse.store.base import CorruptEntryError
from kvfuse.store.redis_value import MAGIC
from kvfuse.weights import load_model


def _cache(seed: int, layers: int = 3, tokens: int = 5, dtype: torch.dtype = torch.float32) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    shape = (layers, 2, tokens, 8)
    return KVCache(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype),
                   torch.arange(3, 3 + tokens))


@pytest.fixture
def fake() -> RedisTier:
    import fakeredis

    return RedisTier("redis://fake", model_fp="model-a", client=fakeredis.FakeRedis())


# -- fast: the format and its checks on fakeredis --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_entry_round_trips_whole_and_layer_by_layer(fake: RedisTier, dtype: torch.dtype) -> None:
    c = _cache(0, dtype=dtype)
    assert fake.put("k1", c) and "k1" in fake and "k2" not in fake  # type: ignore[arg-type,operator]
    got = fake.get("k1")  # type: ignore[arg-type]
    assert got is not None and torch.equal(got.k, c.k) and torch.equal(got.v, c.v)
    assert torch.equal(got.positions, c.positions)
    entry = fake.open("k1")  # type: ignore[arg-type]
    assert entry is not None and len(entry) == 5 and entry.nbytes == c.nbytes
    for i in range(3):
        k, v = entry.layer(i)
        assert torch.equal(k, c.k[i]) and torch.equal(v, c.v[i])
    raw = fake._client.get("kvfuse:k1")
    assert raw.startswith(MAGIC) and len(fake._client.keys("*")) == 1  # one key per entry, no metadata key


def test_the_first_value_written_stays(fake: RedisTier) -> None:
    first, second = _cache(1), _cache(2)
    fake.put("k", first)  # type: ignore[arg-type]
    fake.put("k", second)  # type: ignore[arg-type]
    got = fake.get("k")  # type: ignore[arg-type]
    assert got is not None and torch.equal(got.k, first.k)


def _damage(tier: RedisTier, how: str, key: str = "k") -> None:
    """Change the value stored for key as a fault or a stranger would."""
    raw = tier._client.get(tier._rkey(key))  # type: ignore[arg-type]
    if how == "truncated":
        raw = raw[:-7]
    elif how == "flipped":
        raw = bytearray(raw)
        raw[-3] ^= 0x10
        raw = bytes(raw)
    elif how == "foreign":
        header_len = int.from_bytes(raw[4:8], "little")
        header = json.loads(raw[8 : 8 + header_len])
        header["model"] = "another-model"
        new = json.dumps(header, separators=(",", ":")).encode()
        raw = raw[:4] + len(new).to_bytes(4, "little") + new + raw[8 + header_len :]
    elif how == "garbage":
        raw = b"not a cache entry at all"
    elif how == "renamed":
        tier.put("other", _cache(3))  # type: ignore[arg-type]
        raw = tier._client.get(tier._rkey("other"))  # type: ignore[arg-type]
    tier._client.set(tier._rkey(key), raw)  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["truncated", "flipped", "foreign", "garbage", "renamed"])
def test_a_bad_value_is_a_miss_and_is_dropped(fake: RedisTier, how: str) -> None:
    fake.put("k", _cache(0))  # type: ignore[arg-type]
    _damage(fake, how)
    assert fake.get("k") is None  # type: ignore[arg-type]
    assert fake.corrupt == 1 and fake._client.get("kvfuse:k") is None


def test_a_flipped_byte_is_caught_on_the_layer_it_is_in(fake: RedisTier) -> None:
    fake.put("k", _cache(0))  # type: ignore[arg-type]
    entry = fake.open("k")  # type: ignore[arg-type]
    assert entry is not None
    _damage(fake, "flipped")  # after the open: the last layer's V changes under the reader
    entry.layer(0)
    with pytest.raises(CorruptEntryError, match="layer 2"):
        entry.layer(2)


def test_a_value_evicted_between_lookup_and_read_is_corrupt_not_used(fake: RedisTier) -> None:
    fake.put("k", _cache(0))  # type: ignore[arg-type]
    entry = fake.open("k")  # type: ignore[arg-type]
    assert entry is not None
    fake._client.delete("kvfuse:k")
    with pytest.raises(CorruptEntryError, match="gone"):
        entry.layer(0)


def test_values_past_the_bulk_limit_are_skipped(fake: RedisTier, caplog: pytest.LogCaptureFixture) -> None:
    fake._bulk_limit = 1000
    assert not fake.put("k", _cache(0)) and not fake.put("k2", _cache(1))  # type: ignore[arg-type]
    assert fake._client.get("kvfuse:k") is None and fake.stats.write_failures == 2
    assert sum("proto-max-bulk-len" in r.message for r in caplog.records) == 1  # one warning


def test_namespaces_keep_deployments_apart() -> None:
    import fakeredis

    server = fakeredis.FakeServer()
    a = RedisTier("redis://fake", "m", "team-a:", client=fakeredis.FakeRedis(server=server))
    b = RedisTier("redis://fake", "m", "team-b:", client=fakeredis.FakeRedis(server=server))
    a.put("k", _cache(0))  # type: ignore[arg-type]
    assert "k" in a and "k" not in b and b.get("k") is None  # type: ignore[operator,arg-type]


def test_an_unreachable_redis_is_a_quick_miss_then_backs_off() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tier = RedisTier(f"redis://127.0.0.1:{port}/0", "m", timeout_s=0.2)
    t0 = time.perf_counter()
    assert tier.get("k") is None and "k" not in tier and not tier.put("k", _cache(0))  # type: ignore[arg-type]
    assert time.perf_counter() - t0 < 1.0
    assert tier.stats.errors == 1 and not tier.stats.last_write_ok  # the later calls never touched the network
    assert not tier.backoff.ready()


def test_bad_redis_urls_get_a_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfuse.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--question", "q", "--redis", "http://localhost:6379", "--no-store"])
    assert "redis://HOST:PORT/DB" in str(e.value)


# -- slow: a real redis-server --------------------------------------------------------------------------

slow = pytest.mark.slow


@pytest.fixture(scope="module")
def redis_url() -> str:
    from kvfuse.cluster import redis_server

    with redis_server() as url:
        yield url


def _engine(tiny_models, remote: Remote, store_dir: Path | None = None) -> Engine:  # type: ignore[no-untyped-def]
    lm = load_model(tiny_models["gemma3"][0])
    return Engine(lm.model, lm.fingerprint, store=open_store(store_dir, lm.fingerprint, remote=remote))


def _request(seed: int = 0) -> Request:
    g = torch.Generator().manual_seed(seed)
    ids = [int(x) for x in torch.randint(3, 128, (200,), generator=g)]
    return Request(prefix=(1, *ids[:20]), chunks=(tuple(ids[20:90]), tuple(ids[90:170])), suffix=tuple(ids[170:]))


def _answer(engine: Engine, mode: str = "blend") -> tuple[list[int], object]:
    out = engine.generate(_request(), mode, 0.3)
    engine.store.flush()
    return list(out.tokens), out


def _ns(request: pytest.FixtureRequest) -> str:
    """A namespace of the test's own (no glob characters: KEYS reads it as a pattern)."""
    import hashlib

    return f"t-{hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]}-{os.getpid()}:"


@slow
def test_a_second_process_answers_from_entries_the_first_wrote(tiny_models, redis_url, tmp_path) -> None:
    from servable import servable_checkpoint

    model = servable_checkpoint(tiny_models["gemma3"][0], tmp_path / "model")
    (tmp_path / "a.txt").write_text("The door code is 4812 and the safe is in room 7. " * 3)
    (tmp_path / "b.txt").write_text("Refunds are possible within 30 calendar days of the charge. " * 2)
    cmd = [sys.executable, "-m", "kvfuse", "generate", "--model", str(model), "--chunk-file", str(tmp_path / "a.txt"),
           "--chunk-file", str(tmp_path / "b.txt"), "--question", "What is the code?", "--mode", "blend",
           "--ratio", "0.3", "--max-tokens", "6", "--json", "--no-store", "--redis", redis_url,
           "--redis-namespace", f"proc-{os.getpid()}:"]
    env = {**os.environ, "KVFUSE_CACHE_DIR": str(tmp_path / "cache")}
    first, second = (json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)
                     for _ in range(2))
    assert "redis" not in first["store"]["tiers_used"]  # computed here (then read from memory)
    assert "redis" in second["store"]["tiers_used"] and second["store"]["bytes_read"] > 0  # both chunks, from Redis
    assert second["answer"] == first["answer"] and second["tokens"] == first["tokens"]


@slow
@pytest.mark.parametrize("how", ["truncated", "flipped", "foreign", "garbage"])
def test_bad_values_in_a_real_redis_are_detected_and_recomputed(tiny_models, redis_url, request, how) -> None:
    remote = Remote(redis_url, _ns(request))
    reference, _ = _answer(_engine(tiny_models, remote))
    writer = _engine(tiny_models, remote)
    tier = writer.store.tier("redis")
    assert isinstance(tier, RedisTier)
    keys = tier._client.keys(f"{remote.namespace}*")
    assert keys, "the first engine wrote nothing to Redis"
    for k in keys:  # damage every entry the first engine wrote
        _damage(tier, how, k.decode().removeprefix(remote.namespace))
    reader = _engine(tiny_models, remote)  # a fresh memory tier: every chunk is looked up in Redis
    again, out = _answer(reader)
    shared = reader.store.tier("redis")
    assert again == reference
    assert shared is not None and shared.corrupt >= 1
    assert out.store.corrupt >= 1  # type: ignore[attr-defined]  # found by this request (at open or mid-read)


@slow
def test_redis_stopped_mid_run_leaves_requests_answering(tiny_models) -> None:
    from kvfuse.cluster import redis_server

    with redis_server() as url:
        remote = Remote(url, "stop:", timeout_s=0.2)
        reference, _ = _answer(_engine(tiny_models, remote))
        engine = _engine(tiny_models, remote)
        opened = engine.store.open(engine.cache.chunk_key(_request().chunks[0]))  # found, before the stop
        assert opened is not None and opened.tier == "redis"
    # Redis is gone now: an entry opened before is corrupt on its next read, and new lookups are misses
    with pytest.raises(CorruptEntryError):
        opened.source.layer(0)
    t0 = time.perf_counter()
    again, out = _answer(engine)
    assert again == reference and time.perf_counter() - t0 < 5.0
    shared = engine.store.tier("redis")
    assert shared is not None and shared.stats.errors >= 1 and not shared.stats.last_write_ok


@slow
def test_a_redis_that_never_answers_costs_one_timeout(tiny_models) -> None:
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        plain, _ = _answer(_engine(tiny_models, Remote("redis://127.0.0.1:1/0", timeout_s=0.05)))
        engine = _engine(tiny_models, Remote(url, timeout_s=0.2))
        t0 = time.perf_counter()
        answer, _ = _answer(engine)
        took = time.perf_counter() - t0
    shared = engine.store.tier("redis")
    assert answer == plain and shared is not None and shared.stats.errors >= 1
    assert took < 0.2 * 3 + 2.0  # a timeout or two before the backoff, then the recompute


@slow
def test_two_writers_of_one_key_leave_one_valid_value(redis_url, request) -> None:
    ns = _ns(request)
    tiers = [RedisTier(redis_url, "m", ns) for _ in range(8)]
    caches = [_cache(i, layers=6, tokens=300) for i in range(8)]
    start = threading.Barrier(8)

    def write(i: int) -> None:
        start.wait()
        tiers[i].put("same", caches[i])  # type: ignore[arg-type]

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = tiers[0].get("same")  # type: ignore[arg-type]
    assert got is not None and tiers[0].corrupt == 0
    assert sum(torch.equal(got.k, c.k) and torch.equal(got.v, c.v) for c in caches) == 1


def _kb(tiny_models, tmp: Path, remote: Remote):  # type: ignore[no-untyped-def]
    from chartok import CharTokenizer

    from kvfuse.kb.base import KnowledgeBase

    write_kb(tmp / "kb")
    return KnowledgeBase.open(tmp / "kb", _engine(tiny_models, remote), CharTokenizer())


@slow
def test_the_build_lock_lets_one_replica_build_while_the_other_waits(tiny_models, redis_url, request,
                                                                     tmp_path) -> None:
    remote = Remote(redis_url, _ns(request))
    kbs = [_kb(tiny_models, tmp_path / f"r{i}", remote) for i in range(2)]
    start = threading.Barrier(2)
    reports: list[object] = [None, None]

    def build(i: int) -> None:
        start.wait()
        reports[i] = kbs[i].build("support")

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    computed = sorted(r.tokens_recomputed for r in reports)  # type: ignore[attr-defined]
    assert computed[0] == 0 and computed[1] > 0  # exactly one built; the other read its blocks
    assert sum(r.loaded for r in reports) == 1  # type: ignore[attr-defined]


@slow
def test_a_dead_lock_holder_frees_the_build_after_its_ttl(tiny_models, redis_url, request, tmp_path) -> None:
    import redis

    from kvfuse.store.keys import BlockHash

    remote = Remote(redis_url, _ns(request))
    kb = _kb(tiny_models, tmp_path, remote)
    plan = kb.plan("support", None)
    last: BlockHash = kb.engine.cache.block_hashes(plan.ids, plan.salts)[-1]
    dead = redis.Redis.from_url(redis_url).lock(f"{remote.namespace}lock:prefix:{last}", timeout=1.5)
    assert dead.acquire(blocking=False)  # a holder that will never release or renew it
    t0 = time.perf_counter()
    report = kb.build("support")
    assert report.tokens_recomputed > 0 and 1.0 < time.perf_counter() - t0 < 10.0


@slow
def test_a_unix_socket_url_works(tmp_path) -> None:
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        tier = RedisTier(f"unix://{sock}", "m")
        c = _cache(5)
        assert tier.put("k", c)  # type: ignore[arg-type]
        got = tier.get("k")  # type: ignore[arg-type]
        assert got is not None and torch.equal(got.k, c.k) and tier.stats.errors == 0
    finally:
        proc.terminate()
        proc.wait()


def test_cluster_up_says_what_to_fix() -> None:
    from kvfuse.cli.main import main

    with pytest.raises(SystemExit, match="--redis URL .* or --start-redis"):
        main(["cluster", "up", "--replicas", "2"])
    with pytest.raises(SystemExit, match="--replicas must be at least 1"):
        main(["cluster", "up", "--replicas", "0", "--start-redis"])
    with pytest.raises(SystemExit, match="redis://HOST:PORT/DB"):
        main(["cluster", "up", "--redis", "localhost:6379"])


def test_a_residual_stream_round_trips_and_is_verified_in_redis(fake: RedisTier) -> None:
    """An entry's residual stream (kv.Residual) travels after its layers: read back whole and from an
    opened entry at its layer only; a flipped byte in it is caught there and makes the whole value a miss."""
    from kvfuse.kv import Residual

    base = _cache(4)
    c = KVCache(base.k, base.v, base.positions, Residual(2, torch.randn(5, 6)))
    assert fake.put("r", c)  # type: ignore[arg-type]
    got = fake.get("r")  # type: ignore[arg-type]
    assert got is not None and got.residual is not None and got.residual.layer == 2 and c.residual is not None
    assert torch.equal(got.residual.hidden, c.residual.hidden) and torch.equal(got.k, c.k)
    entry = fake.open("r")  # type: ignore[arg-type]
    assert entry is not None and entry.nbytes == c.nbytes and entry.residual_at(1) is None
    assert torch.equal(entry.residual_at(2), c.residual.hidden)  # type: ignore[arg-type]
    assert torch.equal(entry.layer(2)[1], c.v[2])
    fake.put("plain", base)  # type: ignore[arg-type]
    plain = fake.open("plain")  # type: ignore[arg-type]
    assert plain is not None and plain.residual_at(2) is None
    _damage(fake, "flipped", "r")  # the last bytes: inside the residual
    with pytest.raises(CorruptEntryError, match="residual"):
        entry.residual_at(2)
    assert fake.get("r") is None and fake.corrupt == 1  # type: ignore[arg-type]
