"""The `kvfuse` command line. Thin: it parses flags and calls the library. Each command family is one
module here that registers its subcommands; the families import the runtime and the library, never
each other."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvfuse.cli import cluster, engine, eval, kb, serve

FAMILIES = (engine, eval, kb, serve, cluster)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfuse", description="Answer questions over knowledge with almost no prefill.")
    sub = p.add_subparsers(dest="command", required=True)
    for family in FAMILIES:
        family.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from kvfuse.config import CheckpointError, UnsupportedDeviceError, UnsupportedModelError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (CheckpointError, UnsupportedModelError, UnsupportedDeviceError) as e:  # a bad --model or --device
        raise SystemExit(f"kvfuse: {e}") from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
