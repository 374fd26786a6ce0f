"""Flag helpers every command family shares (not a family itself)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvfuse.precision import DEFAULT_PRECISION, PRECISIONS
from kvfuse.runtime import KV_DTYPES

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
    p.add_argument("--model", default=None, help="a packaged model (gemma3-270m, smollm2-135m-instruct) or a local "
                                                 "HF checkpoint dir (default: Gemma 3 270M, converted once)")
    p.add_argument("--precision", choices=list(PRECISIONS), default=DEFAULT_PRECISION,
                   help="weights and activations: fp32, bf16, or int8 weights with bf16 activations "
                        f"(default: {DEFAULT_PRECISION}); caches of different precisions never mix")


def store_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None, help="KV store directory (default: the user cache dir)")


def store_flags(p: argparse.ArgumentParser) -> None:
    store_flag(p)
    p.add_argument("--no-store", action="store_true", help="keep caches in memory only")
    p.add_argument("--kv-dtype", choices=["auto", *KV_DTYPES], default="auto",
                   help="dtype of stored KV caches (default auto: the precision's, fp32 or bf16)")


def fail(e: Exception) -> SystemExit:
    return SystemExit(f"kvfuse: {e}")
