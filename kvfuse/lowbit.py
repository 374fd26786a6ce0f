"""Weights in 4- or 8-bit groups, multiplied at memory speed for few rows (`kernels/lowbit.c`).

A `Packed` weight is a GGUF's own blocks as the kernel reads them: integers two to a byte (4-bit:
Q4_0, Q4_1, Q4_K) or one to a byte (8-bit: Q5_0, Q5_1, Q5_K, Q6_K, Q8_0), with the float32 scale and
offset of each group of 32 (16 for Q6_K) that `groups.from_blocks` reads, so `dequantize` gives the
GGUF's float weights bit for bit. Products:
- few rows (a decoding step, drafts, a batch: at most `KERNEL_ROWS`): `lb_matmul`, each row rounded to
  int8 per block of 32 (llama.cpp's Q8_0 activations), integer dot products per group, scaled in
  float32. It reads 0.625-0.75 bytes a weight for 4-bit groups (a float32 scale, and an offset, per
  32), 1.125-1.25 for 8-bit ones, not float32's 4.
- more rows (a prefill): the weight dequantised into a reused buffer, `SLICE_ROWS` rows at a time,
  and multiplied by oneDNN: no second copy of the model. In bfloat16 (inputs and weights rounded,
  float32 sums, the product rounded) on CPUs with bfloat16 hardware (`bf16_prefill`), as precision
  bf16's prefill; elsewhere in float32, fp32's arithmetic.

The kernel is C with AVX2 intrinsics (and VNNI's vpdpbusd where the CPU has it), compiled on first use
by the system's C compiler for this CPU's flags into the cache dir and loaded with ctypes; it runs its
loop over output rows on torch's own OpenMP threads (the libgomp torch loads). No kept library ships
such a kernel for x86 (docs/benchmarks.md, stop 60): torchao 0.18's wheels carry no CPU kernels and
its CPU int4 layout is torch's `_weight_int4pack_mm_for_cpu`, which takes bfloat16 scales and zero
points (a GGUF's float32 scales would be rounded) and is no faster at 1-2 rows; FBGEMM's int8 kernel
takes one activation scale per row, which Gemma 3's outlier channels do not survive.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvfuse.defaults import cpu_flags

if TYPE_CHECKING:
    from kvfuse.groups import Groups

SOURCE = Path(__file__).parent / "kernels" / "lowbit.c"
KERNEL_ROWS = 16  # rows up to which products run on the kernel (a step's batch and drafts); more dequantise
SLICE_ROWS = 4096  # weight rows dequantised at a time for a prefill's product


class KernelUnavailable(RuntimeError):
    """The low-bit kernel cannot run here (no x86 AVX2, or no C compiler to build it)."""


def _march() -> list[str]:
    """The compiler's ISA flags for this CPU: AVX2 and FMA at least, VNNI where it has it."""
    flags = cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        raise KernelUnavailable("the low-bit kernel needs an x86 CPU with AVX2, FMA and F16C")
    isa = ["-mavx2", "-mfma", "-mf16c"]
    if {"avx512_vnni", "avx512vl", "avx512bw"} <= flags:
        isa += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
    elif "avx_vnni" in flags:
        isa += ["-mavxvnni"]
    return isa


def _build(out: Path, isa: list[str]) -> None:
    cc = os.environ.get("CC", "cc")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    # -ffp-contract=off: s * q + o rounds twice, as a GGUF's dequantisation does (no fused multiply-add)
    cmd = [cc, "-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", *isa, str(SOURCE), "-o", str(tmp)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise KernelUnavailable(f"the low-bit kernel is built by a C compiler ({cc}), which is not installed") from None
    except subprocess.CalledProcessError as e:
        raise KernelUnavailable(f"building the low-bit kernel failed: {e.stderr.strip()[:500]}") from None
    os.replace(tmp, out)


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernel for this CPU, built once into the cache dir (keyed by its source and flags)."""
    from kvfuse.checkpoints import cache_dir

    isa = _march()
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(isa).encode()).hexdigest()[:16]
    try:
        folder = cache_dir() / "kernels"
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.gettempdir())
    out = folder / f"lowbit-{key}.so"
    if not out.is_file():
        _build(out, isa)
    lib = ctypes.CDLL(str(out))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.lb_quantize.argtypes = [p, i64, i64, p, p, p]
    lib.lb_quantize.restype = None
    lib.lb_matmul.argtypes = [i64, i64, p, p, p, p, i32, i32, p, p, i64, p, i64]
    lib.lb_matmul.restype = None
    lib.lb_dequantize.argtypes = [p, i32, i32, i32, p, p, i64, i64, i64, i64, p]
    lib.lb_dequantize.restype = None
    lib.lb_dequantize_bf16.argtypes = [p, i32, i32, i32, p, p, i64, i64, i64, i64, p, p]
    lib.lb_dequantize_bf16.restype = None
    return lib


def available() -> bool:
    """Whether the kernel runs here (built now if it was not)."""
    try:
        library()
    except KernelUnavailable:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Packed:
    """A (rows, cols) weight in `bits`-bit groups of `size` inputs: `data` as the kernel reads it (see
    kernels/lowbit.c), float32 `scale` and optional `offset` (rows, cols // size); the weight is
    scale * (q - zero) + offset. `shift` is the offset the kernel adds, offset - zero * scale (the
    offset itself where zero is 0)."""

    data: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    shift: torch.Tensor | None
    zero: int
    bits: int
    size: int
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.scale.shape[0]), self.cols

    @property
    def nbytes(self) -> int:
        shift = None if self.shift is self.offset else self.shift
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.offset, shift) if t is not None)

    def rows(self, lo: int, hi: int) -> Packed:
        """Output rows lo:hi (views)."""
        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[lo:hi]

        offset = part(self.offset)
        shift = offset if self.shift is self.offset else part(self.shift)
        return Packed(self.data[lo:hi], self.scale[lo:hi], offset, shift, self.zero, self.bits, self.size, self.cols)

    def dequantize(self, lo: int = 0, hi: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows lo:hi of the float32 weight, s * q + o per group (a GGUF's dequantisation, bit for bit)."""
        hi = self.shape[0] if hi is None else hi
        out = torch.empty(hi - lo, self.cols) if out is None else out
        library().lb_dequantize(self.data.data_ptr(), self.bits, self.size, self.zero, self.scale.data_ptr(),
                                _ptr(self.offset),
                                self.shape[0], self.cols, lo, hi, out.data_ptr())
        return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def pack(values: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, size: int, bits: int) -> Packed:
    """Integer values (rows, cols) int8 with their groups' scale and offset, packed for the kernel: 4-bit
    ones two to a byte (values in -8..7, Q4_0's, are held as 0..15 with zero point 8), 8-bit ones as
    they are."""
    rows, cols = values.shape
    zero = 8 if bits == 4 and values.numel() and int(values.min()) < 0 else 0
    values = values + zero if zero else values
    if bits == 4 and (cols % 64 or size != 32):
        raise ValueError(f"4-bit weights come in groups of 32 and runs of 64 columns, not {size} and {cols}")
    if bits == 4:
        if int(values.min()) < 0 or int(values.max()) > 15:
            raise ValueError("4-bit values lie in 0..15")
        runs = values.to(torch.uint8).view(rows, cols // 64, 2, 32)
        data = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(rows, cols // 2)
    elif bits == 8:
        data = values.to(torch.int8).view(torch.uint8).contiguous()
    else:
        raise ValueError(f"bits is 4 or 8, not {bits}")
    scale = scale.float().contiguous()
    offset = None if offset is None else offset.float().contiguous()
    shift = offset if not zero else (-zero * scale if offset is None else offset - zero * scale)
    return Packed(data.contiguous(), scale, offset, shift, zero, bits, size, cols)


_scratch = threading.local()


def _buffer(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's reused scratch of at least numel elements (one set in inference mode, one outside)."""
    key = f"{name}-{torch.is_inference_mode_enabled()}"
    buf = getattr(_scratch, key, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_scratch, key, buf)
    return buf[:numel]


def bf16_prefill() -> bool:
    """Whether a prefill's products run in bfloat16 here: on CPUs with bfloat16 hardware (AVX-512 BF16,
    AMX), where oneDNN multiplies bfloat16 about twice as fast as float32 (elsewhere float32)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def attention_dtype() -> torch.dtype | None:
    """A lowbit model's `Decoder.attention_dtype`: bfloat16 where its prefill's products are (keys and
    values rounded to it as computed, prefill attention in it, caches stored in it, as bf16's), else none."""
    return torch.bfloat16 if bf16_prefill() else None


def _dequantized(w: Packed, lo: int, hi: int) -> torch.Tensor:
    """Rows lo:hi of the weight in this thread's reused buffer: bfloat16 where `bf16_prefill`, else float32."""
    if not bf16_prefill():
        return w.dequantize(lo, hi, _buffer("weight", (hi - lo) * w.cols, torch.float32).view(hi - lo, w.cols))
    buf = _buffer("weight16", (hi - lo) * w.cols, torch.bfloat16).view(hi - lo, w.cols)
    scratch = _buffer("rows", (os.cpu_count() or 1) * w.cols, torch.float32)
    library().lb_dequantize_bf16(w.data.data_ptr(), w.bits, w.size, w.zero, w.scale.data_ptr(), _ptr(w.offset),
                                 w.shape[0], w.cols, lo, hi, buf.data_ptr(), scratch.data_ptr())
    return buf


def kernel_reads(w: Packed) -> bool:
    """Whether the kernel reads this weight (groups of 16 or 32, its width a whole number of runs);
    others (tiny test shapes) are multiplied dequantised."""
    return w.bits == 4 or (w.size in (16, 32) and w.cols % 32 == 0)


@dataclass(frozen=True, slots=True)
class Rounded:
    """Float rows (rows, cols) rounded as the kernel reads them (lb_quantize): int8 values, each block of
    32's scale, and each 16 and each 32 inputs' scale * sum; in this thread's scratch, valid until the next call."""

    rows: int
    cols: int
    xq: torch.Tensor
    a: torch.Tensor
    gs: torch.Tensor


def round_rows(flat: torch.Tensor) -> Rounded:
    """Rows (rows, cols) float32, contiguous, cols a multiple of 32, rounded for the kernel (once for
    every part of a layer that reads them)."""
    rows, cols = flat.shape
    xq = _buffer("xq", rows * cols, torch.int8)
    a = _buffer("a", rows * cols // 32, torch.float32)
    gs = _buffer("gs", rows * (cols // 16 + cols // 32), torch.float32)
    library().lb_quantize(flat.data_ptr(), rows, cols, xq.data_ptr(), a.data_ptr(), gs.data_ptr())
    return Rounded(rows, cols, xq, a, gs)


def product_into(out: torch.Tensor, x: Rounded, w: Packed) -> None:
    """out (rows, w.rows), a view whose rows are contiguous (a column slice of a wider output), = the
    rounded rows times the weight, transposed, on the kernel."""
    if out.stride(1) != 1 or out.shape != (x.rows, w.shape[0]):
        raise ValueError("the kernel writes rows of contiguous columns of the output's shape")
    library().lb_matmul(x.rows, x.cols, x.xq.data_ptr(), x.a.data_ptr(), x.gs.data_ptr(), w.data.data_ptr(), w.bits,
                        w.size, w.scale.data_ptr(), _ptr(w.shift), w.shape[0], out.data_ptr(), out.stride(0))


def _float_rows(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.dtype == torch.float32 and flat.is_contiguous() else flat.float().contiguous()


def linear(x: torch.Tensor, parts: list[Packed]) -> torch.Tensor:
    """x (..., cols) times the weights stacked by rows (q, k and v; gate and up), transposed -> (..., rows)
    float32: few rows on the kernel, rounded once for all parts; more on each dequantised weight
    (see the module docstring)."""
    flat = _float_rows(x)
    n = sum(p.shape[0] for p in parts)
    out = torch.empty(flat.shape[0], n)
    on_kernel = flat.shape[0] <= KERNEL_ROWS and all(kernel_reads(p) for p in parts)
    rounded = round_rows(flat) if on_kernel else None
    at = 0
    for w in parts:
        rows = w.shape[0]
        if rounded is not None:
            product_into(out[:, at : at + rows], rounded, w)
        else:
            x = flat.to(torch.bfloat16) if bf16_prefill() else flat
            for lo in range(0, rows, SLICE_ROWS):
                hi = min(rows, lo + SLICE_ROWS)
                out[:, at + lo : at + hi] = F.linear(x, _dequantized(w, lo, hi))
        at += rows
    return out.reshape(*x.shape[:-1], n)


def matmul(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """x (..., cols) times one weight, transposed (`linear` with one part)."""
    return linear(x, [w])


# -- modules ----------------------------------------------------------------------------------------------

def from_groups(g: Groups) -> Packed:
    """A weight's groups (`groups.Groups`: a GGUF's blocks, or 8-bit groups of its own) packed for the
    kernel: 4-bit where every value fits four bits in groups of 32 (Q4_0, Q4_1, Q4_K), else 8-bit."""
    v = g.values
    lo, hi = (int(v.min()), int(v.max())) if v.numel() else (0, 0)
    four = g.size == 32 and g.shape[1] % 64 == 0 and (0 <= lo and hi <= 15 or -8 <= lo and hi <= 7)
    return pack(v, g.scale, g.offset, g.size, 4 if four else 8)


class LowBitRows(nn.Module):
    """A weight held as packed low-bit parts stacked by rows (buffers, so `.to` and `state_dict` see them)."""

    def __init__(self, parts: list[Packed]) -> None:
        super().__init__()
        self.parts = parts
        for i, p in enumerate(parts):
            for name in ("data", "scale", "offset"):
                self.register_buffer(f"part{i}_{name}", getattr(p, name))
            self.register_buffer(f"part{i}_shift", None if p.shift is p.offset else p.shift)
        self.bounds = tuple(itertools.accumulate((p.shape[0] for p in parts), initial=0))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., cols) -> (..., rows) float32."""
        return linear(x, self.parts)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (rows, cols): a GGUF's dequantisation of its blocks, bit for bit."""
        return torch.cat([p.dequantize() for p in self.parts])

    def table(self) -> LowBitTable:
        return LowBitTable(self)

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids (n,) dequantised: (n, cols) float32."""
        if len(self.parts) > 1:
            return self.dequantize()[ids]
        p = self.parts[0]
        picked = Packed(p.data[ids], p.scale[ids], None if p.offset is None else p.offset[ids], None, p.zero, p.bits,
                        p.size, p.cols)
        return picked.dequantize()


class LowBitTable:
    """A weight's rows read as a float32 tensor's (`Decoder.head_weight`): dequantised as they are read."""

    dtype = torch.float32

    def __init__(self, rows: LowBitRows) -> None:
        self.rows = rows
        self.shape = torch.Size((rows.bounds[-1], rows.parts[0].cols))

    def dim(self) -> int:
        return 2

    def __getitem__(self, index: slice | torch.Tensor) -> torch.Tensor:
        if isinstance(index, slice):
            lo, hi, _ = index.indices(self.shape[0])
            return torch.cat([p.dequantize(max(lo - a, 0), min(hi, b) - a)
                              for p, a, b in zip(self.rows.parts, self.rows.bounds, self.rows.bounds[1:], strict=True)
                              if a < hi and lo < b]) if hi > lo else torch.empty(0, self.shape[1])
        return self.rows.take(index.reshape(-1)).reshape(*index.shape, self.shape[1])


class LowBitLinear(LowBitRows):
    """An nn.Linear whose weight is packed low-bit parts (q; k; v of a stacked projection), bias float32."""

    def __init__(self, parts: list[Packed], bias: torch.Tensor | None) -> None:
        super().__init__(parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), False)
        self.out_features, self.in_features = self.bounds[-1], parts[0].cols

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y if self.bias is None else y + self.bias

    def linear_rows(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Output features lo:hi of `forward` alone; lo and hi must be bounds of the parts."""
        if lo not in self.bounds or hi not in self.bounds or hi <= lo:
            raise ValueError(f"rows {lo}:{hi} are not whole parts of {self.bounds}")
        y = linear(x, list(self.parts[self.bounds.index(lo) : self.bounds.index(hi)]))
        return y if self.bias is None else y + self.bias[lo:hi]


class LowBitEmbedding(LowBitRows):
    """An embedding table in one packed part that is also the (tied) LM head (`linear`)."""

    def __init__(self, part: Packed) -> None:
        super().__init__([part])
        self.num_embeddings, self.embedding_dim = part.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids, dequantised: (..., dim) in float32."""
        return self.take(ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)
