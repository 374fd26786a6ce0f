"""The engine over a disk-backed store: restart reuse, integrity, and pipelined layer loading."""

from pathlib import Path

import pytest
import torch
from conftest import rand_ids

from kvfuse.engine import Engine, Request
from kvfuse.kv import KVCache
from kvfuse.loader import LayerLoader
from kvfuse.store import open_store
from kvfuse.store.disk import DiskTier
from kvfuse.weights import load_model


def _disk(e: Engine) -> DiskTier:
    tier = e.store.tier("disk")
    assert isinstance(tier, DiskTier)
    return tier


def _engine(root: Path, store_dir: Path) -> Engine:
    lm = load_model(root)
    return Engine(lm.model, lm.fingerprint, store=open_store(store_dir, lm.fingerprint))


def _request() -> Request:
    return Request(prefix=(1,) + rand_ids(5, 70), chunks=(rand_ids(20, 71), rand_ids(13, 72)), suffix=rand_ids(4, 73))


@pytest.fixture
def warm_store(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    root, _ = tiny_models["gemma3"]
    first = _engine(root, tmp_path)
    req = _request()
    first.precompute(req, "blend")
    first.store.flush()
    logits = first.prefill(req, "blend", 0.3).fused.logits
    cold = first.prefill(req, "full").fused.logits
    return root, tmp_path, req, logits, cold


def test_second_process_reuses_chunks_from_disk(warm_store) -> None:  # type: ignore[no-untyped-def]
    root, store_dir, req, logits, _ = warm_store
    second = _engine(root, store_dir)  # a restart: empty memory, the index rebuilt from the directory
    assert second.precompute(req, "blend") < 1.0
    out = second.generate(req, "blend", 0.3)
    assert out.store.hits >= 2 and "disk" in out.store.tiers_used and out.store.bytes_read > 0
    again = second.prefill(req, "blend", 0.3).fused.logits
    assert torch.allclose(again, logits, atol=1e-5)
    third = second.generate(req, "blend", 0.3)  # promoted to memory by the previous request
    assert "memory" in third.store.tiers_used and "disk" not in third.store.tiers_used


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-8] ^= 0x55
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


@pytest.mark.parametrize("damage", [_flip, _truncate])
def test_damaged_entry_is_dropped_and_recomputed(warm_store, damage) -> None:  # type: ignore[no-untyped-def]
    root, store_dir, req, logits, _ = warm_store
    for f in store_dir.glob("*/*.safetensors"):
        damage(f)
    second = _engine(root, store_dir)
    out = second.generate(req, "blend", 0.3)
    # a truncated header is caught by the start-up scan, a flipped data byte by the layer CRC on read
    assert out.store.corrupt + _disk(second).corrupt >= 1
    assert out.store.misses + out.store.corrupt >= 1  # recomputed, not used
    assert torch.allclose(out.first_logits, logits, atol=1e-5)  # same answer as the cold run


def test_entry_from_another_model_is_never_used(tiny_models, warm_store) -> None:  # type: ignore[no-untyped-def]
    _, store_dir, req, _, _ = warm_store
    other_root, _ = tiny_models["qwen3"]
    other = _engine(other_root, store_dir)
    # chunk keys include the model fingerprint, so another model never even looks these files up
    out = other.generate(req, "blend", 0.3)
    assert out.store.hits == 0 and out.store.misses == 2


def test_pipelined_and_sequential_loading_agree(warm_store) -> None:  # type: ignore[no-untyped-def]
    root, store_dir, req, logits, _ = warm_store
    results = []
    for pipelined in (True, False):
        e = _engine(root, store_dir)
        e.pipelined = pipelined
        results.append(e.prefill(req, "blend", 0.3).fused.logits)
    assert torch.equal(results[0], results[1]) and torch.allclose(results[0], logits, atol=1e-5)


class _SlowSource:
    def __init__(self, n: int, log: list) -> None:  # type: ignore[type-arg]
        self.positions = torch.arange(n)
        self.log = log

    def __len__(self) -> int:
        return len(self.positions)

    def layer(self, i: int):  # type: ignore[no-untyped-def]
        self.log.append(("read", i))
        return torch.zeros(1, len(self), 2), torch.zeros(1, len(self), 2)


@pytest.mark.parametrize("pipelined", [True, False])
def test_loader_reads_the_next_layer_ahead(pipelined: bool) -> None:
    """While layer i is in use (before anyone asks for i+1), layer i+1 is read in the background; a
    loader that is not pipelined reads each layer only when it is asked for."""
    import time

    log: list = []  # type: ignore[type-arg]
    with LayerLoader([_SlowSource(3, log)], num_layers=4, pipelined=pipelined) as loader:
        for i in range(4):
            loader.synchronize(i)
            deadline = time.monotonic() + 5
            while i < 3 and ("read", i + 1) not in log and time.monotonic() < deadline and pipelined:
                time.sleep(0.001)
            log.append(("use", i))
    assert [e for e in log if e[0] == "read"] == [("read", i) for i in range(4)]
    for i in range(3):  # layer i+1 was read before layer i was used, and only when pipelined
        assert (log.index(("read", i + 1)) < log.index(("use", i))) is pipelined, log
    assert len(loader.loaded) == 4


def test_file_renamed_to_another_chunks_key_is_not_used(warm_store, tiny_models) -> None:  # type: ignore[no-untyped-def]
    root, store_dir, req, logits, _ = warm_store
    e = _engine(root, store_dir)
    a, b = (e.cache.chunk_key(c) for c in req.chunks)
    path_a, path_b = (_disk(e).info(k).path for k in (a, b))
    path_b.unlink()
    path_a.rename(path_b)  # chunk b's file now holds chunk a
    fresh = _engine(root, store_dir)
    out = fresh.generate(req, "blend", 0.3)
    assert torch.allclose(out.first_logits, logits, atol=1e-5)
    assert _disk(fresh).corrupt >= 1 and out.store.misses >= 1


def test_file_written_by_another_model_under_the_right_key_is_not_used(warm_store, tiny_models) -> None:  # type: ignore[no-untyped-def]
    from kvfuse.store.disk import DiskTier

    root, store_dir, req, logits, _ = warm_store
    e = _engine(root, store_dir)
    key = e.cache.chunk_key(req.chunks[0])
    forged = DiskTier(store_dir, model_fp="some-other-model")
    forged.put(key, KVCache.concat([e.cache.chunk_cache(req.chunks[0])[0]]).clone())  # same key, foreign model
    fresh = _engine(root, store_dir)
    out = fresh.generate(req, "blend", 0.3)
    assert out.store.corrupt == 1 and torch.allclose(out.first_logits, logits, atol=1e-5)


def test_full_disk_keeps_requests_answering(tiny_models, tmp_path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    import errno
    import os

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    e = _engine(tiny_models["gemma3"][0], tmp_path)
    req = _request()
    out = e.generate(req, "blend", 1.0)
    e.store.flush()
    full = e.generate(req, "full")
    assert out.tokens == full.tokens and "full" in caplog.text
    assert len(_disk(e)) == 0
    assert e.generate(req, "blend", 1.0).store.tiers_used == {"memory"}  # still served from memory


def test_partial_hits_fuse_cached_and_new_chunks(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    e = _engine(tiny_models["llama"][0], tmp_path)
    a, b, c = rand_ids(12, 80), rand_ids(9, 81), rand_ids(15, 82)
    head, q = (1,) + rand_ids(3, 83), rand_ids(3, 84)
    e.precompute(Request(prefix=head, chunks=(a, c), suffix=q), "blend")
    req = Request(prefix=head, chunks=(c, b, a), suffix=q)  # reordered, and b is new
    out = e.generate(req, "blend", 1.0)
    assert out.store.hits == 2 and out.store.misses == 1
    assert torch.allclose(out.first_logits, e.prefill(req, "full").fused.logits, atol=1e-4)


def test_only_the_damaged_entry_is_dropped(warm_store) -> None:  # type: ignore[no-untyped-def]
    root, store_dir, req, logits, _ = warm_store
    e = _engine(root, store_dir)
    bad, good = (e.cache.chunk_key(c) for c in req.chunks)
    _flip(_disk(e).info(bad).path)
    out = e.generate(req, "blend", 0.3)
    assert out.store.corrupt == 1 and torch.allclose(out.first_logits, logits, atol=1e-5)
    assert _disk(e).corrupt == 1  # the good entry was kept and used
    e.store.flush()  # the recomputed chunk was written back, and its new file verifies
    assert _disk(e).get(bad) is not None and _disk(e).get(good) is not None


def test_query_aware_skip_reads_the_residual_streams_from_disk(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """queryaware:skip=2 stores each chunk with its residual stream; after a restart the entries read
    from disk give the same answer, the promoted entries keep their residuals, and skip=0 (no residual)
    is another entry and another answer."""
    from kvfuse.fuse import QueryAware

    root, _ = tiny_models["llama"]
    first = _engine(root, tmp_path)
    req, skip = _request(), QueryAware(skip=2)
    first.precompute(req, skip)
    first.store.flush()
    warm = first.prefill(req, skip, 0.3).fused.logits
    behind = first.cache.chunk_preambles(first.fuser(skip), req)
    keys = [first.cache.chunk_key(c, None, p, 2) for c, p in zip(req.chunks, behind, strict=True)]
    assert all(k in _disk(first) for k in keys)
    second = _engine(root, tmp_path)
    out = second.generate(req, skip, 0.3)
    assert "disk" in out.store.tiers_used and out.store.hits >= 2
    for k in keys:  # promoted into memory with the residual
        hot = second.store.tiers[0].get(k)
        assert hot is not None and hot.residual is not None and hot.residual.layer == 2
    assert torch.allclose(second.prefill(req, skip, 0.3).fused.logits, warm, atol=1e-5)
    plain = [second.cache.chunk_key(c, None, p) for c, p in zip(req.chunks, behind, strict=True)]
    assert not any(k in second.store for k in plain)
    from_zero = second.prefill(req, "queryaware", 0.3).fused.logits
    assert not torch.allclose(from_zero, warm, atol=1e-5) and all(k in second.store for k in plain)
    from kvfuse.request import RequestError

    with pytest.raises(RequestError, match="skip must be below"):
        second.prefill(req, QueryAware(skip=second.cfg.num_layers), 0.3)
