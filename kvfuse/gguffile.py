"""A GGUF read as it is: its tensors under the model's names, one at a time, from the mapped file.

llama.cpp's files differ from a transformers checkpoint in three ways that matter here, each undone as
transformers' own GGUF loading undoes it (`transformers.modeling_gguf_pytorch_utils`), so a tensor read
here equals the one transformers would have converted, bit for bit:
- names: llama.cpp's (`blk.0.attn_q.weight`), found from ours with gguf's own name map;
- a Llama's q and k rows are in llama.cpp's rotary order (pairs interleaved per head): put back;
- a Gemma's norm weights are stored as 1 + w: 1 is subtracted.
A float read dequantises with gguf's own `dequantize` (`float`); a quantised weight's blocks are read
into groups exactly (`groups`, `groups.from_blocks`), its rows put back in the same order.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import torch

from kvfuse.config import CheckpointError, ModelConfig

if TYPE_CHECKING:
    from kvfuse.groups import Groups

# a GGUF value's type -> struct format (gguf's GGUFValueType); 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor's place in the file: its ggml type, its shape as torch holds it (rows first) and where
    its bytes start (absolute)."""

    kind: int
    shape: tuple[int, ...]
    start: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.kind).name

    @property
    def row_bytes(self) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(self.kind)]
        return self.shape[-1] // block * nbytes


@dataclass(frozen=True, slots=True)
class Header:
    """A GGUF's metadata (arrays other than the asked-for ones as their length only) and tensor table."""

    fields: dict[str, Any]
    tensors: dict[str, TensorInfo]


def _string(fh: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", fh.read(8))
    return fh.read(n).decode("utf-8", errors="replace")


def _value(fh: BinaryIO, kind: int, keep: bool) -> Any:
    if kind == 8:
        return _string(fh)
    if kind == 9:
        sub, n = struct.unpack("<IQ", fh.read(12))
        if sub == 8:
            items = [_string(fh) for _ in range(n)] if keep else [fh.seek(struct.unpack("<Q", fh.read(8))[0], 1)
                                                                     for _ in range(n)]
            return items if keep else n
        size = struct.calcsize(_SCALARS[sub])
        data = fh.read(size * n)
        return np.frombuffer(data, dtype=np.dtype(_SCALARS[sub])).tolist() if keep else n
    fmt = _SCALARS[kind]
    return struct.unpack(fmt, fh.read(struct.calcsize(fmt)))[0]


def read_header(file: Path, keep: tuple[str, ...] = ()) -> Header:
    """The header of a GGUF (version 2 or 3), read with plain file reads: arrays are skipped (their
    length kept) but for the fields named in `keep`. CheckpointError where it is not one. Read once per
    file version in a process (a load asks for it twice: the architecture, then the tensors)."""
    try:
        st = file.stat()
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such file") from None
    return _read_header(str(file), st.st_size, st.st_mtime_ns, keep)


@functools.lru_cache(maxsize=8)
def _read_header(name: str, size: int, mtime_ns: int, keep: tuple[str, ...]) -> Header:
    file = Path(name)
    try:
        with open(file, "rb") as fh:
            magic, version, n_tensors, n_fields = struct.unpack("<4sIQQ", fh.read(24))
            if magic != b"GGUF" or version not in (2, 3):
                raise ValueError(f"magic {magic!r}, version {version}")
            if n_tensors > 1 << 20 or n_fields > 1 << 20:
                raise ValueError(f"{n_tensors} tensors and {n_fields} fields")
            fields: dict[str, Any] = {}
            for _ in range(n_fields):
                key = _string(fh)
                (kind,) = struct.unpack("<I", fh.read(4))
                fields[key] = _value(fh, kind, key in keep)
            infos = []
            for _ in range(n_tensors):
                name = _string(fh)
                (dims,) = struct.unpack("<I", fh.read(4))
                shape = struct.unpack(f"<{dims}Q", fh.read(8 * dims))
                kind, offset = struct.unpack("<IQ", fh.read(12))
                infos.append((name, kind, tuple(int(d) for d in reversed(shape)), offset))
            align = int(fields.get("general.alignment", 32))
            data = -(-fh.tell() // align) * align
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such file") from None
    except (OSError, ValueError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not a GGUF file llama.cpp writes ({e})") from None
    return Header(fields, {name: TensorInfo(kind, shape, data + off) for name, kind, shape, off in infos})


def read_bytes(file: Path, info: TensorInfo, rows: slice | None = None) -> np.ndarray:
    """A tensor's raw bytes (rows, bytes a row), or a slice of its rows, read from the file into memory
    (no mapping: nothing of the file stays resident once converted)."""
    n_rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    lo, hi, _ = (rows or slice(None)).indices(n_rows)
    out = np.empty((max(0, hi - lo), info.row_bytes), dtype=np.uint8)
    with open(file, "rb", buffering=0) as fh:
        got = os.preadv(fh.fileno(), [out.reshape(-1).data], info.start + lo * info.row_bytes)
    if got != out.nbytes:
        raise CheckpointError(f"{file} ends inside a tensor: truncated?")
    return out


BLOCK_ROWS = 4096  # rows of a weight's blocks decoded at a time


class GGUFTensors:
    """The tensors of a GGUF by our checkpoint names (`layers.0.self_attn.q_proj.weight`, ...): each read,
    dequantised or as groups, only when asked for; nothing is read at opening but the header."""

    def __init__(self, file: Path, cfg: ModelConfig, names: list[str]) -> None:
        """`names`: the checkpoint names the model needs (its unstacked weights)."""
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

        self.file, self.cfg = file, cfg
        header = read_header(file)
        self.arch = str(header.fields.get("general.architecture"))
        arch_id = next((k for k, v in MODEL_ARCH_NAMES.items() if v == self.arch), None)
        if arch_id is None:
            raise CheckpointError(f"{file}: gguf does not know the architecture {self.arch!r}")
        theirs = header.tensors
        name_map = get_tensor_name_map(arch_id, cfg.num_layers)
        self.tensors: dict[str, TensorInfo] = {}
        for name in names:
            ours = name.removesuffix(".weight").removesuffix(".bias")
            base = name_map.get_name("model." + ours) or name_map.get_name(ours)
            suffix = ".bias" if name.endswith(".bias") else ".weight"
            if base is not None and f"{base}{suffix}" in theirs:
                self.tensors[name] = theirs[f"{base}{suffix}"]

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as torch holds it (rows first)."""
        return self.tensors[name].shape

    def _row_order(self, name: str) -> np.ndarray | None:
        """The rows of a Llama's q or k weight (or bias) in transformers' order, as indices into the file's."""
        if self.arch != "llama" or not (".q_proj." in name or ".k_proj." in name):
            return None
        heads = self.cfg.num_heads if ".q_proj." in name else self.cfg.num_kv_heads
        rows = self.shape(name)[0]
        return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)

    def float(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """The tensor (or a slice of its rows) in float32, as transformers converts it."""
        from gguf import GGMLQuantizationType, dequantize

        t = self.tensors[name]
        w = np.asarray(dequantize(read_bytes(self.file, t, rows), GGMLQuantizationType(t.kind)), dtype=np.float32)
        w = w.reshape(-1, *self.shape(name)[1:])
        order = self._row_order(name)
        if order is not None:
            w = w[order]
        if self.arch == "gemma3" and name.endswith("norm.weight"):
            w = w - np.float32(1)
        return torch.from_numpy(np.ascontiguousarray(w))

    def groups(self, name: str) -> Groups | None:
        """A 2-D weight's own blocks as groups (`groups.from_blocks`), or None for a type they do not hold;
        decoded `BLOCK_ROWS` rows at a time into the whole's arrays (a table's decoding temporaries would
        otherwise be several times its size)."""
        from kvfuse.groups import BLOCKS, Groups, from_blocks

        t = self.tensors[name]
        shape = self.shape(name)
        if len(shape) != 2 or t.type_name not in BLOCKS:
            return None
        rows, cols = shape

        def block(lo: int) -> Groups:
            g = from_blocks(t.type_name, read_bytes(self.file, t, slice(lo, lo + BLOCK_ROWS)),
                            min(BLOCK_ROWS, rows - lo), cols)
            assert g is not None
            return g

        first = block(0)
        per_row = first.scale.shape[1]
        g = Groups(torch.empty(rows, cols, dtype=torch.int8), torch.empty(rows, per_row),
                   None if first.offset is None else torch.empty(rows, per_row), first.size)
        for lo in range(0, rows, BLOCK_ROWS):
            part = first if lo == 0 else block(lo)
            g.values[lo : lo + BLOCK_ROWS] = part.values
            g.scale[lo : lo + BLOCK_ROWS] = part.scale
            if g.offset is not None and part.offset is not None:
                g.offset[lo : lo + BLOCK_ROWS] = part.offset
        order = self._row_order(name)
        return g if order is None else g.rows(torch.from_numpy(order))


class GGUFRows:
    """A GGUF weight read a block of rows at a time as float32 (`quant.Rows`): never whole."""

    def __init__(self, tensors: GGUFTensors, name: str) -> None:
        self.tensors, self.name = tensors, name
        self.shape = tensors.shape(name)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if self.tensors._row_order(self.name) is not None:  # a q or k weight: whole (never a table)
            return self.tensors.float(self.name)[rows]
        return self.tensors.float(self.name, rows)
