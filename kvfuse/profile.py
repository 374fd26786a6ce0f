"""Measuring the controller's profile: full prefills at a few lengths and a read from each tier, once
per model and machine, kept under the cache dir. It needs an engine; the policy (`policy`) does not.
A model's calibration (`kvfuse calibrate`, measured by `eval.calibrate`) is kept beside it."""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvfuse.kv import HOST
from kvfuse.policy import DEFAULT_COST_PER_GB, Calibration, Profile, TierProfile, calibration_path

if TYPE_CHECKING:
    from kvfuse.engine.core import Engine


def profile_path(cache_dir: Path, model_fp: str, device: torch.device = HOST) -> Path:
    """Where the model's profile on this machine is kept: one per device type, as a prefill's cost is the
    device's (the CPU's keeps the name it always had)."""
    on = "" if device.type == "cpu" else f"-{device.type}"
    return cache_dir / "profiles" / f"{model_fp[:16]}-{platform.node() or 'machine'}{on}.json"


def load_or_profile(engine: Engine, cache_dir: Path, store_dir: Path | None, refresh: bool = False,
                    costs: dict[str, float] | None = None) -> Profile:
    """The saved profile of this model on this machine, measuring it first if there is none."""
    path = profile_path(cache_dir, engine.fingerprint, engine.model.device)
    if path.is_file() and not refresh:
        try:
            return Profile.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged profile is measured again
    prof = measure(engine, store_dir, costs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(prof.to_json(), indent=1))
    os.replace(tmp, path)
    return prof


def measure(engine: Engine, store_dir: Path | None, costs: dict[str, float] | None = None,
            lengths: tuple[int, ...] = (256, 1024, 2048)) -> Profile:
    """Time full prefills at a few lengths and a read of a KV cache from each tier."""
    from kvfuse import fuse
    from kvfuse.store.base import CorruptEntryError
    from kvfuse.store.disk import DiskTier

    costs = {**DEFAULT_COST_PER_GB, **(costs or {})}
    cfg = engine.cfg
    gen = torch.Generator().manual_seed(0)
    per_token: dict[int, float] = {}
    sample = None
    with torch.inference_mode():
        for n in lengths:
            ids = torch.randint(4, cfg.vocab_size, (n,), generator=gen).to(engine.model.device)
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                out = fuse.prefill(engine.model, ids)
                times.append(time.perf_counter() - t0)
            per_token[n] = min(times) / n
            sample = out.cache.to(engine.kv_dtype, HOST)  # the store's tiers hold host tensors
    assert sample is not None
    kv_per_token = sample.nbytes // len(sample)
    tiers = {"memory": TierProfile(_copy_rate(sample), costs["memory"])}
    with tempfile.TemporaryDirectory(dir=store_dir if store_dir is not None and store_dir.is_dir() else None) as tmp:
        disk = DiskTier(Path(tmp), model_fp=engine.fingerprint)
        disk.put("profile-probe", sample)  # type: ignore[arg-type]
        rates = []
        for _ in range(3):
            path = disk.info("profile-probe").path  # type: ignore[arg-type,union-attr]
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            t0 = time.perf_counter()
            entry = disk.open("profile-probe")  # type: ignore[arg-type]
            assert entry is not None
            for i in range(entry.layers):
                entry.layer(i)
            rates.append(sample.nbytes / (time.perf_counter() - t0))
        tiers["disk"] = TierProfile(statistics.median(rates), costs["disk"])
    shared = engine.store.tier("redis")
    if shared is not None and shared.put("profile-probe", sample):  # type: ignore[arg-type]
        rates = []
        for _ in range(3):
            t0 = time.perf_counter()
            probe = shared.open("profile-probe")  # type: ignore[arg-type]
            if probe is None:
                break
            try:
                for i in range(engine.cfg.num_layers):
                    probe.layer(i)
            except CorruptEntryError:  # Redis went away mid-read: no rate measured
                break
            rates.append(sample.nbytes / (time.perf_counter() - t0))
        if rates:
            tiers["redis"] = TierProfile(statistics.median(rates), costs["redis"])
    return Profile(engine.fingerprint, platform.node(), int(kv_per_token), per_token, tiers)


def _copy_rate(cache: Any) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        cache.clone()
        times.append(time.perf_counter() - t0)
    return float(cache.nbytes / min(times))


def save_calibration(cal: Calibration, cache_dir: Path) -> Path:
    path = calibration_path(cache_dir, cal.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cal.to_json(), indent=1), encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_calibration(cache_dir: Path, model_fp: str) -> Calibration | None:
    """This model's calibration, if one was measured (a damaged file reads as none)."""
    try:
        return Calibration.from_json(json.loads(calibration_path(cache_dir, model_fp).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
