"""Byte budgets and the store's health: LRU by bytes on a full filesystem, a budget lowered between
runs, the --memory-bytes/--disk-bytes flags, and the store metrics (corrupt entries, write failures,
evictions) as Prometheus reads them."""

import argparse
import errno
from pathlib import Path

import pytest
import torch
from serverutil import samples

from kvfuse.cli.args import budget_flags, byte_size
from kvfuse.kv import KVCache
from kvfuse.server.metrics import Metrics
from kvfuse.store import open_store
from kvfuse.store.disk import DiskTier


def _cache(seed: int, n: int = 16) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    return KVCache(torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g), torch.arange(n))


def _filesystem_of(tier: DiskTier, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make writes fail with ENOSPC once the files on disk would pass `size` bytes (a small filesystem)."""
    real = DiskTier._write

    def write(path: Path, data: bytes) -> None:
        on_disk = sum(p.stat().st_size for p in tier.root.glob("*/*.safetensors") if p != path)
        if on_disk + len(data) > size:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(DiskTier, "_write", staticmethod(write))


def test_a_full_filesystem_evicts_lru_first_and_keeps_pins(tmp_path: Path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    tier = DiskTier(tmp_path, capacity_bytes=1 << 30, model_fp="m")  # a budget far past the filesystem
    assert tier.put("aa01", _cache(0), pin=True)  # type: ignore[arg-type]
    one = tier.used_bytes
    _filesystem_of(tier, 3 * one, monkeypatch)
    assert tier.put("aa02", _cache(1)) and tier.put("aa03", _cache(2))  # type: ignore[arg-type]
    tier.get("aa02")  # type: ignore[arg-type]  # aa03 is now the least recently used unpinned entry
    assert tier.put("aa04", _cache(3))  # type: ignore[arg-type]
    assert set(tier.keys()) == {"aa01", "aa02", "aa04"} and tier.stats.evictions == 1
    assert tier.stats.write_failures == 0 and tier.stats.last_write_ok
    tier.pin("aa02")  # type: ignore[arg-type]
    tier.pin("aa04")  # type: ignore[arg-type]
    assert not tier.put("aa05", _cache(4))  # type: ignore[arg-type]  # all pinned: nothing can make room
    assert tier.stats.write_failures == 1 and not tier.stats.last_write_ok and "full" in caplog.text
    assert set(tier.keys()) == {"aa01", "aa02", "aa04"} and not list(tmp_path.glob("*/.tmp-*"))
    tier.unpin("aa04")  # type: ignore[arg-type]
    assert tier.put("aa05", _cache(4)) and tier.stats.last_write_ok  # type: ignore[arg-type]
    assert "aa04" not in tier and torch.equal(tier.get("aa05").k, _cache(4).k)  # type: ignore[arg-type,operator,union-attr]


def test_a_budget_lowered_between_runs_evicts_at_start(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, model_fp="m")
    for i in range(4):
        tier.put(f"bb0{i}", _cache(i), pin=i == 0)  # type: ignore[arg-type]
    one = tier.used_bytes // 4
    smaller = DiskTier(tmp_path, capacity_bytes=2 * one, model_fp="m")
    assert smaller.used_bytes <= 2 * one and len(list(tmp_path.glob("*/*.safetensors"))) == len(smaller) == 2
    assert "bb03" in smaller  # type: ignore[operator]  # the most recent entry stays; bb00 was pinned then, not now


def test_budget_flags_reach_the_store(tmp_path: Path) -> None:
    assert byte_size("512M") == 512 << 20 and byte_size("20G") == 20 << 30 and byte_size("1.5KiB") == 1536
    assert byte_size("123456") == 123456
    for bad in ("lots", "0", "-5G"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)
    p = argparse.ArgumentParser()
    budget_flags(p)
    args = p.parse_args(["--disk-bytes", "3M", "--memory-bytes", "1M"])
    store = open_store(tmp_path, "m", capacity={"memory": args.memory_bytes, "disk": args.disk_bytes})
    assert {t.name: t.capacity_bytes for t in store.tiers} == {"memory": 1 << 20, "disk": 3 << 20}


def _tier(metrics: Metrics, name: str, tier: str) -> float:
    from prometheus_client import generate_latest

    return samples(generate_latest(metrics.registry).decode(), name)[f"tier={tier}"]


def test_store_metrics_count_corrupt_entries_failures_and_evictions(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    store = open_store(tmp_path, "m", capacity={"memory": 1 << 20, "disk": 1 << 30})
    store.put("cc01", _cache(0))  # type: ignore[arg-type]
    store.flush()
    path = next(tmp_path.glob("*/*.safetensors"))
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))
    again = open_store(tmp_path, "m", capacity={"memory": 1 << 20, "disk": 1 << 30})  # a restart: memory empty
    m = Metrics(again, lambda: 0)
    assert _tier(m, "kvfuse_store_corrupt_total", "disk") == 0
    assert again.get("cc01") is None  # type: ignore[arg-type]  # detected on the read, dropped, counted
    assert _tier(m, "kvfuse_store_corrupt_total", "disk") == 1 and _tier(m, "kvfuse_store_tier_up", "disk") == 1
    disk = again.tier("disk")
    assert isinstance(disk, DiskTier)
    _filesystem_of(disk, 0, monkeypatch)  # nothing fits any more
    assert not disk.put("cc02", _cache(1))  # type: ignore[arg-type]
    assert _tier(m, "kvfuse_store_write_failures_total", "disk") == 1 and _tier(m, "kvfuse_store_tier_up", "disk") == 0
    assert _tier(m, "kvfuse_store_capacity_bytes", "memory") == 1 << 20
    for i in range(3):  # the memory tier holds about one entry and a half: puts evict
        again.tiers[0].put(f"dd0{i}", _cache(i, n=2000))  # type: ignore[arg-type]
    assert _tier(m, "kvfuse_store_evictions_total", "memory") >= 1
