"""Weight-only int8 layers: each output row of a weight is stored as int8 with one bfloat16 scale.

`w[j] ~= q[j] * scale[j]` with `scale[j] = max|w[j]| / 127`. The matmul is PyTorch's own weight-only
int8 kernel (`torch._weight_int8pack_mm`), which takes bfloat16 activations on x86 and returns
bfloat16; it reads a quarter of float32's bytes, which is what a memory-bound decoding step pays for.
The kernel gives each row the same result whatever the batch, so batched decoding stays bitwise equal
to a lone request (tested).

`Int8Embedding` is a tied table: the token embeddings are its rows, dequantised on lookup, and the LM
head is the same int8 matrix (Gemma 3's 262k x 640 table is 168 MB instead of 671 MB, stored once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACT_DTYPE = torch.bfloat16  # the kernel's activation (and scale) dtype


QUANT_ROWS = 4096  # rows quantised at a time: the float temporaries of a 262k-row table stay small


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, bfloat16 scale per row) of a (rows, cols) weight, rounded to nearest; done in blocks
    of rows, which gives every row the same result as all at once."""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=ACT_DTYPE)
    for at in range(0, weight.shape[0], QUANT_ROWS):
        w = weight[at : at + QUANT_ROWS].detach().float()
        s = (w.abs().amax(1) / 127).clamp_min(1e-12).to(ACT_DTYPE)
        q[at : at + QUANT_ROWS] = torch.round(w / s.float()[:, None]).clamp(-127, 127)
        scale[at : at + QUANT_ROWS] = s
    return q, scale


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., cols) times the dequantised (rows, cols) weight, transposed -> (..., rows) in bfloat16."""
    flat = x.reshape(-1, x.shape[-1]).to(ACT_DTYPE).contiguous()
    return torch._weight_int8pack_mm(flat, q, scale).reshape(*x.shape[:-1], q.shape[0])


def available() -> bool:
    """Whether this PyTorch has the weight-only int8 kernel."""
    return hasattr(torch, "_weight_int8pack_mm")


class Int8Rows(nn.Module):
    """A weight held as int8 rows and their scales, and its product with inputs (`linear`)."""

    q: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, scale = quantize_rows(weight)
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., cols) -> (..., rows) in bfloat16."""
        return int8_matmul(x, self.q, self.scale)


class Int8Linear(Int8Rows):
    """An nn.Linear with its weight in int8 rows (bias, if any, in bfloat16)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(ACT_DTYPE), False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y if self.bias is None else y + self.bias


class Int8Embedding(Int8Rows):
    """An embedding table in int8 rows that is also the (tied) LM head (`linear`)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__(embedding.weight)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids, dequantised: (..., dim) in bfloat16."""
        return F.embedding(ids, self.q).to(ACT_DTYPE) * self.scale[ids].unsqueeze(-1)
