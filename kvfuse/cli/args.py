"""Flag helpers every command family shares (not a family itself)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kvfuse.precision import PRECISIONS, default_precision
from kvfuse.runtime import KV_DTYPES

if TYPE_CHECKING:
    from kvfuse.store.base import Remote

RATIO_HELP = ("the recompute ratio, between 0 and 1 (default: the mode's own, blend 0.15, queryaware 0.2), "
              "or auto (the loading controller)")


def ratio(value: str) -> float | str:
    """argparse type for --ratio."""
    from kvfuse.request import parse_ratio

    try:
        return parse_ratio(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--ratio: {e}") from None


def read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SystemExit(f"kvfuse: cannot read {flag} {path}: {e.strerror}") from None


def model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a packaged model (gemma3-270m, smollm2-135m-instruct), a GGUF file "
                                                 "(Llama, Mistral, Qwen2, Qwen3, Gemma 3; read as it is) or a "
                                                 "local HF checkpoint dir (default: Gemma 3 270M)")
    p.add_argument("--precision", choices=list(PRECISIONS), default=default_precision(),
                   help="weights: fp32, bf16 (bfloat16 products) or int8 (activations float32), w8a8 (int8 "
                        "weights and activation rows), groups (a GGUF's own quantised blocks, exactly; "
                        "slower, a third of fp32's memory), or lowbit (a GGUF's blocks at 4 or 8 bits on "
                        "kvfuse's low-bit kernel: for 1B-8B models); the default is the fastest one as faithful as "
                        f"llama.cpp's Q4_K_M on this CPU (default: {default_precision()}); caches of different "
                        "precisions never mix")
    p.add_argument("--device", default="cpu",
                   help="where the model computes: cpu (the default), or an accelerator torch has here, such as "
                        "cuda or cuda:1 (fp32 or bf16); the KV store stays in host memory and on disk")


def store_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None, help="KV store directory (default: the user cache dir)")


def redis_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", default=None, metavar="URL",
                   help="a shared Redis (or Valkey) tier after memory and disk: redis://HOST:PORT/DB or "
                        "unix:///path/to.sock; replicas and processes on it reuse each other's caches")
    p.add_argument("--redis-namespace", default="kvfuse:", help="prefix of every key in Redis (default kvfuse:)")
    p.add_argument("--redis-timeout-ms", type=float, default=200.0,
                   help="each Redis call's timeout; past it the entry is a miss (default 200)")


def remote(args: argparse.Namespace) -> Remote | None:
    """The Redis tier the flags ask for, checked; None without --redis."""
    from kvfuse.store.base import Remote
    from kvfuse.store.redis import check_url

    if not getattr(args, "redis", None):
        return None
    if not args.redis_timeout_ms > 0:
        raise SystemExit(f"kvfuse: --redis-timeout-ms must be positive, got {args.redis_timeout_ms}")
    try:
        return Remote(check_url(args.redis), args.redis_namespace, args.redis_timeout_ms / 1000)
    except ValueError as e:
        raise SystemExit(f"kvfuse: {e}") from None


def store_flags(p: argparse.ArgumentParser) -> None:
    store_flag(p)
    redis_flags(p)
    p.add_argument("--no-store", action="store_true", help="keep caches in memory only")
    p.add_argument("--kv-dtype", choices=["auto", *KV_DTYPES], default="auto",
                   help="dtype of stored KV caches (default auto: the one that holds the precision's KV exactly, "
                        "bf16 for --precision bf16, else fp32)")


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(value: str) -> int:
    """argparse type for byte budgets: 123456, 512M, 20G, 1.5T (binary units, an optional trailing B/iB)."""
    v = value.strip().upper().removesuffix("IB").removesuffix("B")
    unit = v[-1:] if v[-1:] in _UNITS and v[-1:] else ""
    try:
        n = float(v[: len(v) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a size; write bytes, or a number with K, M, G or T "
                                         "(binary units), like 512M or 20G") from None
    if not n >= 1:
        raise argparse.ArgumentTypeError(f"{value!r}: a byte budget must be at least 1 byte")
    return int(n)


def budget_flags(p: argparse.ArgumentParser) -> None:
    from kvfuse.defaults import DEFAULT_CAPACITY  # a light import: no torch

    p.add_argument("--memory-bytes", type=byte_size, default=DEFAULT_CAPACITY["memory"],
                   help="the memory tier's budget (LRU by bytes, pinned entries kept; default 4G)")
    p.add_argument("--disk-bytes", type=byte_size, default=DEFAULT_CAPACITY["disk"],
                   help="the disk tier's budget (LRU by bytes, pinned entries kept; a full filesystem evicts "
                        "too; default 20G)")


def fail(e: Exception) -> SystemExit:
    return SystemExit(f"kvfuse: {e}")
