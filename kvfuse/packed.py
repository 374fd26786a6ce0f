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

Decoding steps (`step`). oneDNN reads a bfloat16 weight for 2 to 8 rows at about 15 GB/s on the
machines here, while FBGEMM's float16-weight product (`torch.ops.quantized.linear_dynamic_fp16`, the
kernel of PyTorch's dynamic float16 linears) reads the same bytes at up to twice that, converting the
weight to float32 in registers and multiplying float32 rows (docs/benchmarks.md, stop 51). So a
bfloat16 layer also keeps its weight in float16 for decoding steps (`steps=True`): the same values,
since every bfloat16 number of float16's normal range (2^-14 to 65504 in magnitude) is a float16
number, and the few smaller weights round to float16's subnormal step (2^-24, a rounding finer than
bfloat16's own for all but the tiniest). A step multiplies its float32 rows unrounded, which is a
little closer to fp32 than the prefill's bfloat16 rows. Each row's result depends on that row alone
(checked at load by `decode.batch_limit`), so batched and drafted steps stay bitwise equal to a lone
step; a prefill and a step of the same token differ in rounding, as they did before. The copy costs
the layer weights' memory once more (about 200 MB for Gemma 3 270M); FBGEMM's kernel is slow for many
rows, so prefills keep the oneDNN path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def available() -> bool:
    """Whether this PyTorch has oneDNN's packed linear (x86 and Arm builds with mkldnn)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def fp16_steps_available() -> bool:
    """Whether this PyTorch has FBGEMM's float16-weight linear (x86 builds with FBGEMM)."""
    engines = torch.backends.quantized.supported_engines
    return ("fbgemm" in engines or "x86" in engines) and hasattr(torch.ops.quantized, "linear_dynamic_fp16")


# oneDNN's post-operations for an MLP's activation (`PackedLinear.gated`): attr and algorithm of
# `_linear_pointwise`, applied to the float32 sums before they are rounded
POST_OPS = {"gelu_tanh": ("gelu", "tanh"), "silu": ("swish", "")}


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, post: tuple[str, str] = ("none", "")
             ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, post[0], [], post[1])  # type: ignore[no-any-return]


class PackedLinear(nn.Module):
    """An nn.Linear (float32) whose weight is held in `dtype` (float32 or bfloat16), in oneDNN's layout
    where it runs on the CPU, in parts of rows (`splits`)."""

    def __init__(self, linear: nn.Linear, splits: tuple[int, ...] = (), dtype: torch.dtype = torch.float32,
                 steps: bool = False) -> None:
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
        # decoding steps' copy (see the module docstring): float16 holding the weight as `dtype` rounds it
        # (none where a weight exceeds float16's range: FBGEMM would clamp it)
        copy = steps and dtype == torch.bfloat16 and self.onednn and fp16_steps_available() and (
            not weight.numel() or bool(weight.abs().max() <= torch.finfo(torch.float16).max))
        self.step_parts = [torch.ops.quantized.linear_prepack_fp16(weight.to(dtype).float(), bias)] if copy else []

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
        outs = self.each(x)
        return torch.cat(outs, -1) if len(outs) > 1 else outs[0]

    def each(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each part's columns of `forward` for rows x (rows, in_features), not joined: `linear_rows`'s
        products without its reshapes and checks (a step makes 90 of these calls, and every operator
        call costs microseconds), and a prefill's q and its k and v without a copy of them all."""
        flat = self._rows(x)
        return [self._product(flat, p, bias) for p, bias in zip(self.parts, self.biases, strict=True)]

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x in the layer's dtype, contiguous, as the products read them (no copy where they are)."""
        flat = x if x.dtype == self.dtype else x.to(self.dtype)
        return flat if flat.is_contiguous() else flat.contiguous()

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """The product for the rows (rows, in_features) of a decoding step: on the float16 copy where
        the layer keeps one (the whole weight, one call whatever its parts), else `forward`."""
        if not self.step_parts:
            return self.forward(x)
        return torch.ops.quantized.linear_dynamic_fp16(x if x.is_contiguous() else x.contiguous(), self.step_parts[0])

    def gates(self, activation: str) -> bool:
        """Whether `gated` runs here: a bfloat16 layer on oneDNN in two parts (gate rows, up rows) without
        bias, for an activation oneDNN applies in its product (`POST_OPS`)."""
        return (self.onednn and self.dtype == torch.bfloat16 and len(self.parts) == 2 and self.biases[0] is None
                and activation in POST_OPS)

    def gated(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """An MLP's hidden rows act(gate) * up, in bfloat16, from rows x (rows, in_features) of a layer
        whose two parts are the gate's rows and the up's (`gates`). The activation runs inside the gate's
        product, on its float32 sums, and each product is rounded once; the down projection reads the
        result as it is. Against `forward`, then the activation and the product in float32: one rounding
        moves (after the activation instead of before), no float32 copies of the products are made, and
        a 715-row prefill's MLP takes 15 ms instead of 17-18 (Gemma 3 270M, docs/benchmarks.md, stop 54)."""
        flat = self._rows(x)
        gate = _product(flat, self.parts[0], None, POST_OPS[activation])
        return gate.mul_(_product(flat, self.parts[1], None))

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
                f"dtype={self.dtype}, float16 steps={bool(self.step_parts)}")
