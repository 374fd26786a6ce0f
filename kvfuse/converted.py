"""A converted model kept beside its checkpoint and mapped at later loads (precision lowbit).

Packing a GGUF's blocks into the low-bit kernel's layout reads and repacks every weight (about 4 s for a
1B model here, where llama.cpp maps its file in under one). What it makes depends only on the file and
the layout, so the first load writes the whole converted model to `<checkpoint dir>/lowbit-<LAYOUT>.
safetensors` (every tensor, and which modules are low-bit with their parts' formats, under the model's
fingerprint), and later loads map it (`mapped.map_safetensors`): nothing is read until a product first
touches it, and processes running the same model share its pages, as llama.cpp's do. It costs the
model's size once more on disk; a file of another fingerprint or layout is made again.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from kvfuse.config import ModelConfig
from kvfuse.lowbit import LowBitEmbedding, LowBitLinear, LowBitRows, Packed, attention_dtype
from kvfuse.mapped import map_safetensors
from kvfuse.model import Decoder

LAYOUT = 1  # the kernel's layout of `lowbit.Packed`; a new one whenever it changes


def file_for(root: Path) -> Path:
    return root / f"lowbit-{LAYOUT}.safetensors"


def save(model: Decoder, root: Path, fingerprint: str) -> None:
    """Write the converted model beside its checkpoint, atomically; a read-only dir only means packing
    again at the next load."""
    from safetensors.torch import save_file

    modules = {}
    for path, m in model.named_modules():
        if isinstance(m, LowBitRows):
            modules[path] = {"kind": "embedding" if isinstance(m, LowBitEmbedding) else "linear",
                             "parts": [[p.bits, p.size, p.zero, p.cols] for p in m.parts]}
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    meta = {"fingerprint": fingerprint, "layout": str(LAYOUT), "modules": json.dumps(modules)}
    out = file_for(root)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        save_file(state, str(tmp), metadata=meta)
        os.replace(tmp, out)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def load(root: Path, cfg: ModelConfig, fingerprint: str) -> Decoder | None:
    """The kept converted model, its tensors views of the mapped file; None where there is none of this
    fingerprint and layout (or it cannot be read: it is made again)."""
    file = file_for(root)
    if not file.is_file():
        return None
    try:
        tensors, meta = map_safetensors(file)
        if meta.get("fingerprint") != fingerprint or meta.get("layout") != str(LAYOUT):
            return None
        modules = json.loads(meta["modules"])
        with torch.device("meta"):
            model = Decoder(cfg)
        for path, spec in modules.items():
            parts = []
            for i, (bits, size, zero, cols) in enumerate(spec["parts"]):
                offset = tensors.get(f"{path}.part{i}_offset")
                shift = tensors.get(f"{path}.part{i}_shift", offset)
                parts.append(Packed(tensors[f"{path}.part{i}_data"], tensors[f"{path}.part{i}_scale"], offset, shift,
                                    zero, bits, size, cols))
            made: nn.Module = (LowBitEmbedding(parts[0]) if spec["kind"] == "embedding"
                               else LowBitLinear(parts, tensors.get(f"{path}.bias")))
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, made)
        def made_above(key: str) -> bool:
            return any(key.startswith(p + ".") for p in modules)

        result = model.load_state_dict({k: v for k, v in tensors.items() if not made_above(k)}, assign=True,
                                       strict=False)
        if [k for k in result.missing_keys if not made_above(k)] or result.unexpected_keys:
            return None
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):
        return None
    model.attention_dtype = attention_dtype()  # as `precision.convert` sets it
    return model.eval().requires_grad_(False)
