"""Read-only tensor views of a safetensors file, mapped into memory (no copy).

safetensors' Python API copies every tensor it reads; a view into the file's mapping costs nothing at
open, shares the page cache with every process that maps the same file, and reads a page only when a
product first touches it (llama.cpp loads its GGUFs the same way). The store's disk tier reads its
entries so (`store.disk`), and precision lowbit its converted model (`converted`). Writers only ever
replace such files by rename, so a mapped file is never truncated under a reader.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from pathlib import Path

import torch

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
          "I8": torch.int8, "U8": torch.uint8}


def map_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The file's tensors as read-only views of its mapping, and its metadata; ValueError where the file
    is shorter than its header says or the header is not one."""
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    if len(mm) < 8:
        raise ValueError(f"{path.name}: too short for a safetensors header")
    (n,) = struct.unpack("<Q", mm[:8])
    if 8 + n > len(mm):
        raise ValueError(f"{path.name}: shorter than its header says")
    header = json.loads(mm[8 : 8 + n])
    base, out = 8 + n, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": these views are never written
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            start, end = spec["data_offsets"]
            if base + end > len(mm):
                raise ValueError(f"{path.name}: shorter than its header says")
            dtype = DTYPES[spec["dtype"]]
            count = (end - start) // dtype.itemsize
            flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + start) if count else torch.empty(
                0, dtype=dtype)
            out[name] = flat.view(spec["shape"])
    return out, dict(header.get("__metadata__") or {})
