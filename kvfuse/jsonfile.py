"""JSON state files: read as one object, replaced atomically. Standard library only, so any layer may use
it (the checkpoint memos in the cache dir, a knowledge base's usage and build records)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any]:
    """The file's object; a missing or damaged one reads as empty (it is state, rebuilt as used)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, data: Any) -> None:
    """Replace the file with data, atomically (a reader sees the old file or the new one, never half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)
