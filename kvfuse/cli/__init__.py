"""The command line: `main.py` and one module per command family."""

from kvfuse.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
