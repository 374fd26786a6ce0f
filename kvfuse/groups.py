"""Weights in groups: small integers with a float32 scale (and an offset) per group of 16 or 32 inputs.

This is the layout of llama.cpp's quantised blocks, and `groups` holds a GGUF's own blocks exactly:
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (groups of 32), Q4_K and Q5_K (sub-blocks of 32, each with a 6-bit scale
and minimum under the block's two halves), Q6_K (sub-blocks of 16). A group's weights are
`scale * q + offset` in float32, the very arithmetic gguf's own dequantisation does, so they equal the
converted float32 checkpoint bit for bit (`Groups.dequantize`; checked when they are read, `from_gguf`).
A checkpoint without blocks (an HF one, a float tensor, a type not listed) is quantised to 8-bit groups
of 32 on their own absolute maximum (`quantize`), which is not exact.

The product: no kernel that torch or a kept library ships reads int8 groups with per-group float
scales at memory speed on x86 (docs/benchmarks.md, issue M: torch's int4 kernel takes 4-bit values in
groups of 32 or more only, FBGEMM and `_weight_int8pack_mm` one scale per row), so a product
dequantises the weight a slice of rows at a time and runs the float32 kernel on it. That is exact, and
slower than fp32 (it reads the int8 values and writes float32 ones); what `groups` buys is memory: 1.25 to
1.5 bytes a weight against float32's 4.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvfuse.quant import QUANT_ROWS, Rows

QUANT_GROUP = 32  # the group `quantize` gives a checkpoint without blocks (Q8_0's)
SLICE_ROWS = 4096  # rows dequantised at a time by a product: its float32 buffer stays small (10 MB at 640 wide)


@dataclass(frozen=True, slots=True)
class Groups:
    """A (rows, cols) weight as int8 values (rows, cols), a float32 scale and an optional float32 offset
    per group of `size` consecutive inputs of a row (rows, cols // size)."""

    values: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    size: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.values.shape[0]), int(self.values.shape[1])

    def rows(self, index: slice | torch.Tensor) -> Groups:
        return Groups(self.values[index], self.scale[index], None if self.offset is None else self.offset[index],
                      self.size)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight: scale * q + offset per group."""
        r, c = self.shape
        q = self.values.view(r, c // self.size, self.size).float()
        w = q * self.scale[:, :, None]
        if self.offset is not None:
            w = w + self.offset[:, :, None]
        return w.view(r, c)

    def regroup(self, size: int) -> Groups:
        """The same weights in smaller groups (size divides this one's): each scale repeated."""
        if size == self.size:
            return self
        k = self.size // size
        return Groups(self.values, self.scale.repeat_interleave(k, 1),
                      None if self.offset is None else self.offset.repeat_interleave(k, 1), size)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.scale, self.offset) if t is not None)


def stack(parts: list[Groups]) -> Groups:
    """Weights stacked along rows (q, k and v in one projection), in their smallest group."""
    size = min(p.size for p in parts)
    parts = [p.regroup(size) for p in parts]
    offsets = [p.offset for p in parts]
    if any(o is not None for o in offsets):
        offsets = [torch.zeros_like(p.scale) if p.offset is None else p.offset for p in parts]
    return Groups(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]),
                  None if offsets[0] is None else torch.cat([o for o in offsets if o is not None]), size)


def quantize(weight: Rows, size: int = QUANT_GROUP) -> Groups:
    """8-bit groups of `size` (of the largest that divides a row, for odd widths) on their own absolute
    maximum (a checkpoint without blocks), a block of rows at a time (a table read from its file never
    whole)."""
    r, c = weight.shape[0], weight.shape[1]
    size = math.gcd(c, size)
    q = torch.empty(r, c, dtype=torch.int8)
    scale = torch.empty(r, c // size)
    for at in range(0, r, QUANT_ROWS):
        w = weight[at : at + QUANT_ROWS].detach().float()
        w = w.reshape(w.shape[0], c // size, size)
        s = (w.abs().amax(-1) / 127).clamp_min(1e-12)
        q[at : at + QUANT_ROWS] = torch.round(w / s[:, :, None]).clamp(-127, 127).to(torch.int8).reshape(-1, c)
        scale[at : at + QUANT_ROWS] = s
    return Groups(q, scale, None, size)


# -- GGUF blocks: (values (blocks, groups, size) int8, scale (blocks, groups), offset or None) --------------

def _f16(a: np.ndarray) -> np.ndarray:
    return a.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Low nibbles then high ones of `width`-byte runs: llama.cpp's 4-bit order."""
    n = qs.shape[0]
    out = qs.reshape(n, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (out & np.uint8(0x0F)).reshape(n, -1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of a block's little-endian uint32 high bits, i < count."""
    shifts = np.arange(count, dtype=np.uint32).reshape(1, count)
    return ((qh.view(np.uint32).reshape(-1, 1) >> shifts) & np.uint32(1)).astype(np.uint8)


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return b[:, 2:].view(np.int8)[:, None, :], _f16(b[:, :2]), None


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    q = _nibbles(b[:, 2:], 16).astype(np.int8) - np.int8(8)
    return q[:, None, :], _f16(b[:, :2]), None


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return _nibbles(b[:, 4:], 16).astype(np.int8)[:, None, :], _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5(b: np.ndarray, offset: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    at = 4 if offset else 2
    high = _bits(np.ascontiguousarray(b[:, at : at + 4]), 32) << np.uint8(4)
    q = (_nibbles(b[:, at + 4 :], 16) | high).astype(np.int8)
    if not offset:
        return (q - np.int8(16))[:, None, :], _f16(b[:, :2]), None
    return q[:, None, :], _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return _f16(b[:, :2]) * sc.astype(np.float32), -(_f16(b[:, 2:4]) * m.astype(np.float32))


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    scale, offset = _k_scales(b)
    return _nibbles(b[:, 16:], 32).astype(np.int8).reshape(-1, 8, 32), scale, offset


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    scale, offset = _k_scales(b)
    n = b.shape[0]
    qh = b[:, 16:48].reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = _nibbles(b[:, 48:], 32).reshape(n, 8, 32) | ((qh & np.uint8(1)).reshape(n, 8, 32) << np.uint8(4))
    return q.astype(np.int8), scale, offset


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 64).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (ql | ((qh & np.uint8(3)).reshape(n, 8, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
    scale = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
    return q.reshape(n, 16, 16), scale, None


BLOCKS: dict[str, tuple[int, int, Any]] = {  # type name -> (bytes a block, weights a block, decoder)
    "Q8_0": (34, 32, _q8_0), "Q4_0": (18, 32, _q4_0), "Q4_1": (20, 32, _q4_1),
    "Q5_0": (22, 32, lambda b: _q5(b, False)), "Q5_1": (24, 32, lambda b: _q5(b, True)),
    "Q4_K": (144, 256, _q4_k), "Q5_K": (176, 256, _q5_k), "Q6_K": (210, 256, _q6_k),
}


def from_blocks(kind: str, data: np.ndarray, rows: int, cols: int) -> Groups | None:
    """A GGUF tensor's blocks (its raw bytes, `ReaderTensor.data`) as groups, or None for a type this
    does not read (a float tensor, or another quantisation)."""
    if kind not in BLOCKS:
        return None
    nbytes, per, decode = BLOCKS[kind]
    blocks = np.ascontiguousarray(data).reshape(-1, nbytes)
    q, scale, offset = decode(blocks)
    size = q.shape[-1]
    per_row = cols // size
    return Groups(torch.from_numpy(np.ascontiguousarray(q).reshape(rows, cols)),
                  torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, per_row)),
                  None if offset is None else torch.from_numpy(
                      np.ascontiguousarray(offset, dtype=np.float32).reshape(rows, per_row)),
                  size)


# -- modules ----------------------------------------------------------------------------------------------

_scratch = threading.local()


def _dequantize_into(g: Groups) -> torch.Tensor:
    """g's float32 weight in this thread's scratch buffer (reused, so that no product allocates, and
    page-faults in, a fresh float copy of its weight): valid until the next call. One buffer in
    inference mode and one outside it (an inference tensor cannot be written outside it)."""
    r, c = g.shape
    mode = "inference" if torch.is_inference_mode_enabled() else "plain"
    buf = getattr(_scratch, mode, None)
    if buf is None or buf.numel() < r * c:
        buf = torch.empty(r * c)
        setattr(_scratch, mode, buf)
    w = buf[: r * c].view(r, c // g.size, g.size)
    w.copy_(g.values.view(r, c // g.size, g.size))
    w.mul_(g.scale[:, :, None])
    if g.offset is not None:
        w.add_(g.offset[:, :, None])
    return w.view(r, c)


def group_matmul(x: torch.Tensor, g: Groups) -> torch.Tensor:
    """x (..., cols) times the (rows, cols) weight, transposed, in float32: a slice of at most SLICE_ROWS
    rows dequantised at a time, into a reused buffer."""
    flat = x.reshape(-1, x.shape[-1]).float()
    rows = g.shape[0]
    out = torch.empty(flat.shape[0], rows)
    for at in range(0, rows, SLICE_ROWS):
        part = g.rows(slice(at, at + SLICE_ROWS))
        out[:, at : at + part.shape[0]] = F.linear(flat, _dequantize_into(part))
    return out.reshape(*x.shape[:-1], rows)


class GroupTable:
    """A table in groups read as a float32 tensor's rows (`GreedyHead`'s exact head): indexing
    dequantises just the rows asked for."""

    dtype = torch.float32

    def __init__(self, g: Groups) -> None:
        self.g = g
        self.shape = torch.Size(g.shape)

    def dim(self) -> int:
        return 2

    def __getitem__(self, index: slice | torch.Tensor) -> torch.Tensor:
        return self.g.rows(index).dequantize()


class GroupRows(nn.Module):
    """A weight held as groups (buffers, so `state_dict` and `.to` see them)."""

    values: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None

    def __init__(self, g: Groups) -> None:
        super().__init__()
        self.register_buffer("values", g.values)
        self.register_buffer("scale", g.scale)
        self.register_buffer("offset", g.offset)
        self.size = g.size

    @property
    def groups(self) -> Groups:
        return Groups(self.values, self.scale, self.offset, self.size)

    def table(self) -> GroupTable:
        """The weight's rows, dequantised as they are read (an LM head's, for `GreedyHead`)."""
        return GroupTable(self.groups)


class GroupLinear(GroupRows):
    """An nn.Linear whose weight is groups (bias, if any, float32)."""

    def __init__(self, g: Groups, bias: torch.Tensor | None) -> None:
        super().__init__(g)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), False)
        self.out_features, self.in_features = g.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = group_matmul(x, self.groups)
        return y if self.bias is None else y + self.bias

    def linear_rows(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Output features lo:hi of `forward` alone."""
        y = group_matmul(x, self.groups.rows(slice(lo, hi)))
        return y if self.bias is None else y + self.bias[lo:hi]


class GroupEmbedding(GroupRows):
    """An embedding table in groups that is also the (tied) LM head (`linear`)."""

    def __init__(self, g: Groups) -> None:
        super().__init__(g)
        self.num_embeddings, self.embedding_dim = g.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids, dequantised: (..., dim) in float32."""
        flat = ids.reshape(-1)
        return self.groups.rows(flat).dequantize().reshape(*ids.shape, self.embedding_dim)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return group_matmul(x, self.groups)
