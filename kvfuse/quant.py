"""Weight-only int8 layers: each output row of a weight is stored as int8 with one bfloat16 scale.

`w[j] ~= q[j] * scale[j]` with `scale[j] = max|w[j]| / 127`. Activations stay in the model's float
dtype (float32): only the weights are int8. A product of up to KERNEL_ROWS rows (a decoding step, a
short suffix) runs PyTorch's own weight-only int8 kernel (`torch._weight_int8pack_mm`), which reads a
quarter of float32's bytes, what a memory-bound decoding step pays for; it takes its input rounded to
bfloat16 and its result is widened back. The kernel gives each row the same result whatever the batch,
so batched decoding stays bitwise equal to a lone request (tested). A longer product (a prefill slice)
is compute-bound, and there the kernel is slower than the float one on CPUs without AMX (measured:
2x at 512 rows on AVX2), so the weight is dequantised and the float kernel runs.

`Int8Embedding` is a tied table: the token embeddings are its rows, dequantised on lookup, and the LM
head is the same int8 matrix (Gemma 3's 262k x 640 table is 168 MB instead of 671 MB, stored once).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

ACT_DTYPE = torch.bfloat16  # the int8 kernel's input (and scale) dtype
KERNEL_ROWS = 96  # products of at most this many rows run the int8 kernel; longer ones dequantise (see above)


QUANT_ROWS = 4096  # rows quantised at a time: the float temporaries of a 262k-row table stay small


class Rows(Protocol):
    """A (rows, cols) float weight read a block of rows at a time: a tensor, or a checkpoint's table
    that the loader reads from its file block by block (`checkpoints.FileRows`), never whole."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __getitem__(self, rows: slice) -> torch.Tensor: ...


def quantize_rows(weight: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, bfloat16 scale per row) of a (rows, cols) weight, rounded to nearest; done in blocks
    of rows, which gives every row the same result as all at once."""
    q = torch.empty(tuple(weight.shape), dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=ACT_DTYPE)
    for at in range(0, weight.shape[0], QUANT_ROWS):
        w = weight[at : at + QUANT_ROWS].detach().float()
        s = (w.abs().amax(1) / 127).clamp_min(1e-12).to(ACT_DTYPE)
        q[at : at + QUANT_ROWS] = torch.round(w / s.float()[:, None]).clamp(-127, 127)
        scale[at : at + QUANT_ROWS] = s
    return q, scale


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., cols) times the dequantised (rows, cols) weight, transposed -> (..., rows) in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    # torch's AVX-512 int8 kernel reads past a row whose length is not a multiple of 16 (a segfault on
    # such CPUs; the AVX2 kernel does not); every real model's widths are, tiny test shapes may not be
    if flat.shape[0] <= KERNEL_ROWS and q.shape[1] % 16 == 0:
        out = torch._weight_int8pack_mm(flat.to(ACT_DTYPE).contiguous(), q, scale).to(x.dtype)
    else:
        out = F.linear(flat, dequantize(q, scale, x.dtype))
    return out.reshape(*x.shape[:-1], q.shape[0])


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (..., cols) rows that int8 rows (..., cols) and their scales (...) stand for, in dtype."""
    return q.to(dtype) * scale.to(dtype).unsqueeze(-1)


def available() -> bool:
    """Whether this PyTorch has the weight-only int8 kernel."""
    return hasattr(torch, "_weight_int8pack_mm")


class Int8Rows(nn.Module):
    """A weight held as int8 rows and their scales, and its product with inputs (`linear`)."""

    q: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: Rows) -> None:
        super().__init__()
        q, scale = quantize_rows(weight)
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., cols) -> (..., rows) in x's dtype."""
        return int8_matmul(x, self.q, self.scale)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """Casting the module (`model.float()`) keeps the scales in the kernel's dtype."""
        super()._apply(fn, recurse)
        self.scale = self.scale.to(ACT_DTYPE)
        return self


class Int8Linear(Int8Rows):
    """An nn.Linear with its weight in int8 rows (bias, if any, as it was)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y if self.bias is None else y + self.bias

    def linear_rows(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Output features lo:hi of `forward` alone."""
        y = int8_matmul(x, self.q[lo:hi], self.scale[lo:hi])
        return y if self.bias is None else y + self.bias[lo:hi]


class Int8Embedding(Int8Rows):
    """An embedding table in int8 rows that is also the (tied) LM head (`linear`)."""

    def __init__(self, weight: Rows) -> None:
        """From the float table (an nn.Embedding's weight, or its rows in the checkpoint file)."""
        super().__init__(weight)
        self.num_embeddings, self.embedding_dim = self.q.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids, dequantised: (..., dim) in float32."""
        return dequantize(F.embedding(ids, self.q), self.scale[ids], torch.float32)
