import errno
import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from kvfuse.kv import KVCache
from kvfuse.store.base import CorruptEntryError
from kvfuse.store.disk import DiskTier
from kvfuse.store.memory import MemoryTier
from kvfuse.store.tiered import TieredStore


def _cache(n: int = 6, seed: int = 0, layers: int = 3) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    return KVCache(torch.randn(layers, 2, n, 4, generator=g), torch.randn(layers, 2, n, 4, generator=g),
                   torch.arange(1, n + 1))


def _same(a: KVCache | None, b: KVCache) -> bool:
    return a is not None and torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.positions, b.positions)


def test_round_trip_and_index_survives_restart(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, model_fp="m1")
    c = _cache()
    assert tier.put("ab12", c)  # type: ignore[arg-type]
    assert _same(tier.get("ab12"), c)  # type: ignore[arg-type]
    again = DiskTier(tmp_path, model_fp="m1")  # a new process: the index comes from the directory
    assert "ab12" in again and _same(again.get("ab12"), c)  # type: ignore[arg-type,operator]
    entry = again.open("ab12")  # type: ignore[arg-type]
    assert entry is not None and torch.equal(entry.layer(2)[0], c.k[2])


def _corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF  # inside the tensor data, past the header
    path.write_bytes(bytes(data))


def _corrupt_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-40])


@pytest.mark.parametrize("damage", [_corrupt_flip, _corrupt_truncate])
def test_damaged_files_are_detected_and_dropped(tmp_path: Path, damage) -> None:  # type: ignore[no-untyped-def]
    tier = DiskTier(tmp_path, model_fp="m1")
    tier.put("cd34", _cache())  # type: ignore[arg-type]
    damage(tier.info("cd34").path)  # type: ignore[arg-type,union-attr]
    assert tier.get("cd34") is None  # type: ignore[arg-type]
    assert tier.corrupt == 1 and "cd34" not in tier and not list(tmp_path.glob("*/*.safetensors"))


def test_file_renamed_to_another_key_is_rejected(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, model_fp="m1")
    tier.put("aa11", _cache(seed=1))  # type: ignore[arg-type]
    src = tier.info("aa11").path  # type: ignore[arg-type,union-attr]
    dst = tmp_path / "bb" / "bb22.safetensors"
    dst.parent.mkdir()
    os.rename(src, dst)
    fresh = DiskTier(tmp_path, model_fp="m1")
    assert fresh.get("bb22") is None and fresh.get("aa11") is None  # type: ignore[arg-type]
    assert not dst.exists()


def test_file_from_another_model_is_rejected(tmp_path: Path) -> None:
    DiskTier(tmp_path, model_fp="other-model").put("ee55", _cache())  # type: ignore[arg-type]
    tier = DiskTier(tmp_path, model_fp="m1")
    assert tier.get("ee55") is None and tier.corrupt == 1  # type: ignore[arg-type]


def _writer(root: str, seed: int) -> None:
    tier = DiskTier(root, model_fp="m1")
    for _ in range(20):
        tier.put("ff66", _cache(n=64, seed=seed))  # type: ignore[arg-type]


def test_two_processes_writing_the_same_key_leave_one_valid_entry(tmp_path: Path) -> None:
    procs = [mp.get_context("spawn").Process(target=_writer, args=(str(tmp_path), s)) for s in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    tier = DiskTier(tmp_path, model_fp="m1")
    got = tier.get("ff66")  # type: ignore[arg-type]
    assert got is not None and (_same(got, _cache(64, 1)) or _same(got, _cache(64, 2)))
    assert len(list(tmp_path.glob("*/*.safetensors"))) == 1 and not list(tmp_path.glob("*/.tmp-*"))


def test_full_disk_warns_and_keeps_going(tmp_path: Path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    tier = DiskTier(tmp_path, model_fp="m1")
    real_fsync = os.fsync

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    assert tier.put("aa77", _cache()) is False  # type: ignore[arg-type]
    assert "full" in caplog.text and not list(tmp_path.glob("*/.tmp-*")) and "aa77" not in tier
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert tier.put("aa77", _cache())  # type: ignore[arg-type]


def test_capacity_lru_and_pins(tmp_path: Path) -> None:
    size = len(_cache().k.numpy().tobytes()) * 2 + 2000  # roughly one file
    probe = DiskTier(tmp_path / "probe")
    probe.put("00aa", _cache())  # type: ignore[arg-type]
    one = probe.info("00aa").nbytes  # type: ignore[arg-type,union-attr]
    assert one < size
    tier = DiskTier(tmp_path / "t", capacity_bytes=3 * one, model_fp="m1")
    for i, key in enumerate(["k1", "k2", "k3"]):
        tier.put(key, _cache(seed=i), pin=key == "k1")  # type: ignore[arg-type]
    tier.get("k2")  # type: ignore[arg-type]
    tier.put("k4", _cache(seed=4))  # type: ignore[arg-type]
    assert set(tier.keys()) == {"k1", "k2", "k4"}  # k3 was least recently used; k1 is pinned
    assert tier.used_bytes <= tier.capacity_bytes
    tier.get("k1")  # type: ignore[arg-type]
    tier.put("k5", _cache(seed=5))  # type: ignore[arg-type]
    assert "k1" in tier and "k2" not in tier  # type: ignore[operator]
    restarted = DiskTier(tmp_path / "t", capacity_bytes=3 * one, model_fp="m1")
    assert restarted.keys()[-1] == "k5"  # LRU order survives a restart through file mtimes


def test_tiered_store_writes_back_and_promotes(tmp_path: Path) -> None:
    store = TieredStore([MemoryTier(), DiskTier(tmp_path, model_fp="m1")])
    c = _cache()
    store.put("9abc", c)  # type: ignore[arg-type]
    store.flush()
    assert "9abc" in store.tiers[1]
    cold = TieredStore([MemoryTier(), DiskTier(tmp_path, model_fp="m1")])
    assert _same(cold.get("9abc"), c)  # type: ignore[arg-type]
    assert cold.stats.tiers_used == {"disk"} and cold.stats.bytes_read == c.nbytes
    assert _same(cold.get("9abc"), c) and cold.stats.tiers_used == {"disk", "memory"}  # type: ignore[arg-type]
    assert cold.get("nope") is None and cold.stats.misses == 1  # type: ignore[arg-type]
    store.close()


def _with_residual(c: KVCache, layer: int = 1, width: int = 5) -> KVCache:
    from kvfuse.kv import Residual

    g = torch.Generator().manual_seed(7)
    return KVCache(c.k, c.v, c.positions, Residual(layer, torch.randn(len(c), width, generator=g)))


def test_a_residual_stream_round_trips_and_is_verified(tmp_path: Path) -> None:
    """A chunk entry's residual stream (kv.Residual) is stored beside its KV: read back whole, from an
    opened entry at its layer only, promoted with the entry, and a flipped byte in it is caught."""
    tier = DiskTier(tmp_path, model_fp="m1")
    c = _with_residual(_cache())
    assert tier.put("ee55", c)  # type: ignore[arg-type]
    got = DiskTier(tmp_path, model_fp="m1").get("ee55")  # type: ignore[arg-type]
    assert _same(got, c) and got is not None and got.residual is not None and c.residual is not None
    assert got.residual.layer == 1 and torch.equal(got.residual.hidden, c.residual.hidden)
    entry = tier.open("ee55")  # type: ignore[arg-type]
    assert entry is not None and entry.residual_at(2) is None
    assert torch.equal(entry.residual_at(1), c.residual.hidden)  # type: ignore[arg-type]
    store = TieredStore([MemoryTier(), DiskTier(tmp_path, model_fp="m1")])
    opened = store.open("ee55")  # type: ignore[arg-type]
    assert opened is not None and opened.promote
    store.promote("ee55", [opened.source.layer(i) for i in range(3)], opened.source.positions,  # type: ignore[arg-type]
                  c.residual)
    hot = store.tiers[0].get("ee55")  # type: ignore[arg-type]
    assert hot is not None and hot.residual is not None and torch.equal(hot.residual.hidden, c.residual.hidden)
    assert tier.put("ff66", _cache(seed=2))  # type: ignore[arg-type]
    plain = tier.open("ff66")  # type: ignore[arg-type]
    assert plain is not None and plain.residual_at(1) is None  # an entry without one
    path = tier.info("ee55").path  # type: ignore[arg-type,union-attr]
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    start, _ = json.loads(data[8 : 8 + n])["residual"]["data_offsets"]
    data[8 + n + start + 3] ^= 0xFF  # a byte of the residual's data
    path.write_bytes(bytes(data))
    damaged = DiskTier(tmp_path, model_fp="m1")
    entry = damaged.open("ee55")  # type: ignore[arg-type]
    assert entry is not None
    with pytest.raises(CorruptEntryError, match="residual"):
        entry.residual_at(1)
    assert damaged.get("ee55") is None and damaged.corrupt == 1  # type: ignore[arg-type]


def test_store_verify_exits_1_on_damage_and_drops_it_only_with_repair(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`kvfuse store verify` lists damaged entries and exits 1, so a script or a cron job notices; the
    entries stay for a look until `--repair` drops them; a sound store exits 0."""
    from kvfuse.cli.main import main

    tier = DiskTier(tmp_path, model_fp="m1")
    tier.put("aa11", _cache(seed=1))  # type: ignore[arg-type]
    tier.put("bb22", _cache(seed=2))  # type: ignore[arg-type]
    assert main(["store", "verify", "--store", str(tmp_path)]) == 0
    _corrupt_flip(tier.info("bb22").path)  # type: ignore[arg-type,union-attr]
    capsys.readouterr()
    assert main(["store", "verify", "--store", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out.strip().splitlines()[-1])
    assert [c["key"] for c in report["corrupt"]] == ["bb22"] and report["ok"] == 1 and report["dropped"] == 0
    assert "--repair" in err
    assert "bb22" in DiskTier(tmp_path, model_fp="m1")  # still there
    assert main(["store", "verify", "--repair", "--store", str(tmp_path)]) == 1
    assert json.loads(capsys.readouterr()[0].strip().splitlines()[-1])["dropped"] == 1
    assert "bb22" not in DiskTier(tmp_path, model_fp="m1")
    assert main(["store", "verify", "--store", str(tmp_path)]) == 0
