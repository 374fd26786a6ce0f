"""Linear layers with their weights prepacked for oneDNN, PyTorch's own CPU kernels
(`torch.ops.mkldnn._linear_pointwise`, what torch.compile's CPU backend runs for a frozen linear), in
float32 (precision fp32) or bfloat16 (precision bf16). Both take and return float32.

A decoding step multiplies 2 to 8 rows by every weight. For such products the BLAS behind `F.linear`
reads a weight at 6-9 GB/s on the 2-core machines here; the same weight reordered once into oneDNN's
blocked layout is read at 15-20 GB/s, and long products (a prefill) run no slower (measured:
docs/benchmarks.md). Each output row of a packed product depends only on its own input row for 2
rows and more (`decode.batch_limit` checks this on the model at hand), so batched decoding stays
bitwise equal to a lone request.

A bfloat16 layer rounds its input to bfloat16, multiplies with float32 accumulation (AMX on CPUs that
have it: a prefill's products run about ten times faster than float32's), and widens the product back
to float32 before its bias is added; everything around it (norms, the residual stream, attention,
the KV) stays float32. Where oneDNN cannot run it (no oneDNN, or an accelerator), a bfloat16 layer
holds its plain bfloat16 weight and runs `F.linear`.

The packed weight replaces the plain one, which is then freed (a model holds its weights once);
`state_dict()` still names `weight` (and `bias`), unpacked on request. A stacked projection
(q, k and v) is packed as one part per `splits` entry, so that `linear_rows` can run the query rows
or the key and value rows alone and give exactly the columns `forward` gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def available() -> bool:
    """Whether this PyTorch has oneDNN's packed linear (x86 and Arm builds with mkldnn)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # type: ignore[no-any-return]


class PackedLinear(nn.Module):
    """An nn.Linear (float32) whose weight is held in `dtype` (float32 or bfloat16), in oneDNN's layout
    where it runs on the CPU, in parts of rows (`splits`)."""

    def __init__(self, linear: nn.Linear, splits: tuple[int, ...] = (), dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if linear.weight.dtype != torch.float32:
            raise TypeError(f"a packed linear is made from a float32 one, got {linear.weight.dtype}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"a packed linear holds float32 or bfloat16, not {dtype}")
        self.in_features, self.out_features, self.dtype = linear.in_features, linear.out_features, dtype
        self.onednn = available() and linear.weight.device.type == "cpu"
        if not self.onednn and dtype == torch.float32:
            raise ValueError("a float32 linear is packed only where oneDNN runs it (the plain layer is as good)")
        self.bounds = (0, *splits, self.out_features)  # the parts' first rows, and the end
        weight, bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
        rows = list(zip(self.bounds, self.bounds[1:], strict=False))
        self.parts = [self._pack(weight[lo:hi].to(dtype).contiguous()) for lo, hi in rows]
        self.biases = [None if bias is None else bias[lo:hi].clone() for lo, hi in rows]

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w, 2) if self.onednn else w  # type: ignore[no-any-return]

    def _product(self, x: torch.Tensor, part: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.dtype == torch.float32:  # float32: the bias is added inside the kernel
            return _product(x, part, bias)
        out = (_product(x, part, None) if self.onednn else F.linear(x, part)).float()
        return out if bias is None else out + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.linear_rows(x, 0, self.out_features)
        # rows of a decoding step: `linear_rows`'s products without its reshapes and checks (a step
        # makes 90 of these calls, and every operator call costs microseconds)
        flat = x if x.dtype == self.dtype else x.to(self.dtype)
        flat = flat if flat.is_contiguous() else flat.contiguous()
        outs = [self._product(flat, p, bias) for p, bias in zip(self.parts, self.biases, strict=True)]
        return torch.cat(outs, -1) if len(outs) > 1 else outs[0]

    def linear_rows(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Output features lo:hi of `forward` alone; lo and hi must be bounds of the parts."""
        if lo not in self.bounds or hi not in self.bounds or hi <= lo:
            raise ValueError(f"rows {lo}:{hi} are not whole parts of {self.bounds}")
        flat = x.reshape(-1, x.shape[-1]).to(self.dtype).contiguous()
        a, b = self.bounds.index(lo), self.bounds.index(hi)
        outs = [self._product(flat, p, bias) for p, bias in zip(self.parts[a:b], self.biases[a:b], strict=True)]
        out = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
        return out.reshape(*x.shape[:-1], hi - lo)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        """The state names the plain weight (and bias), as an nn.Linear's: unpacked on request."""
        destination[prefix + "weight"] = torch.cat([p.to_dense() if self.onednn else p for p in self.parts])
        if self.biases[0] is not None:
            destination[prefix + "bias"] = torch.cat([b for b in self.biases if b is not None])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, parts={self.bounds}, "
                f"dtype={self.dtype}")
