"""int8 weights times int8 activations, each activation row quantised on its own (precision `w8a8`).

A weight is int8 rows with one scale per output row, exactly `quant.quantize_rows` (int8's weights).
Each input row x is rounded to integers on its own scale, `s = max|x| / LEVELS`, and the product of the
integers runs in FBGEMM (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`, PyTorch's x86
int8 engine, what `torch.ao` dynamic quantisation calls): u8 x s8 products summed in int32, exactly,
then scaled by the row's weight scale. Multiplying by s gives float32 again.

Why per row. FBGEMM's own dynamic linear quantises a whole batch with one scale, so a request's row
would change with its neighbours; here the kernel is given rows already divided by their own scale,
with scale 1, so each output row depends on its own input row alone (the integer sums are exact, and
the scaling is element-wise): batched decoding stays bitwise equal to a lone request, and a prompt's
row is the same whether the prompt is prefilled whole or as a suffix after a cache.

Why LEVELS depends on the CPU. Without VNNI (AVX2, and AVX-512 before Cascade Lake) FBGEMM multiplies
u8 x s8 pairs with vpmaddubsw, whose pairwise sums saturate at int16: 2 x 255 x 127 does not fit, so
there activations get 7 bits (|q| <= 63 around zero point 64, FBGEMM's `reduce_range`). With VNNI
(vpdpbusd sums in int32) they get 8 bits (|q| <= 127 around 128). `levels()` reads the CPU's flags.

Speed (AMD EPYC, AVX-512 VNNI, 2 threads): Gemma 3's 262k x 640 head at 2 rows in 6.1 ms against 14.7
for `_weight_int8pack_mm` and about 50 for float32; a 4096 x 640 projection at 512 rows in 5.4 ms against
13.2 for oneDNN's packed float32 (docs/benchmarks.md). PyTorch marks its quantised tensor types as
deprecated; this module is where a successor kernel would go.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from kvfuse.defaults import cpu_flags
from kvfuse.quant import Int8Embedding, Rows, quantize_rows

_VNNI = ("avx512_vnni", "avx_vnni", "amx_int8")


@functools.cache
def levels() -> int:
    """The largest |integer| an activation is rounded to on this CPU: 127 with VNNI, else 63."""
    flags = cpu_flags()  # none known: the range that cannot saturate
    return 127 if any(f in flags for f in _VNNI) else 63


def available() -> bool:
    """Whether this PyTorch has FBGEMM's int8 linear (x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32")


def pack(q: torch.Tensor, scale: torch.Tensor) -> torch.ScriptObject:
    """FBGEMM's packed form of int8 rows (rows, cols) with one scale per row (no bias: it is added after)."""
    engine = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "fbgemm"
        with warnings.catch_warnings():  # quantised tensors are deprecated; FBGEMM's packing still takes one
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(
                q.contiguous(), scale.double(), torch.zeros(q.shape[0], dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qw, None)
    finally:
        torch.backends.quantized.engine = engine


def round_rows(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(integers in [-levels(), levels()], scale (rows, 1)) of float rows (rows, cols): row i is ints[i] * s[i]
    as the kernel reads it."""
    s = flat.abs().amax(1, keepdim=True).clamp_min(1e-30) / levels()  # each row's own scale
    return torch.round(flat / s), s


def matmul(x: torch.Tensor, packed: torch.ScriptObject, out_features: int) -> torch.Tensor:
    """x (..., cols) float times the packed int8 rows, transposed -> (..., out_features) float32."""
    ints, s = round_rows(x.reshape(-1, x.shape[-1]).float())
    # the kernel adds the zero point to the integers (exact in u8) and sums their products in int32
    out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(ints, 1.0, levels() + 1, packed)
    return (out * s).reshape(*x.shape[:-1], out_features)


class W8A8Linear(nn.Module):
    """An nn.Linear as int8 rows (one scale each) that multiplies int8 activation rows, in parts of rows
    (`splits`: q, then k and v, of a stacked projection, which `linear_rows` runs alone)."""

    def __init__(self, linear: nn.Linear, splits: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bounds = (0, *splits, self.out_features)
        q, scale = quantize_rows(linear.weight)
        rows = list(zip(self.bounds, self.bounds[1:], strict=False))
        self.parts = [pack(q[lo:hi], scale[lo:hi]) for lo, hi in rows]
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.biases = [None if bias is None else bias[lo:hi].clone() for lo, hi in rows]
        self.register_buffer("scale", scale)  # kept for the state dict and `precision.of`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_rows(x, 0, self.out_features)

    def linear_rows(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Output features lo:hi of `forward` alone; lo and hi must be bounds of the parts."""
        if lo not in self.bounds or hi not in self.bounds or hi <= lo:
            raise ValueError(f"rows {lo}:{hi} are not whole parts of {self.bounds}")
        a, b = self.bounds.index(lo), self.bounds.index(hi)
        outs = []
        for (p_lo, p_hi), part, bias in zip(zip(self.bounds[a:b], self.bounds[a + 1 : b + 1], strict=True),
                                            self.parts[a:b], self.biases[a:b], strict=True):
            y = matmul(x, part, p_hi - p_lo)
            outs.append(y if bias is None else y + bias)
        return torch.cat(outs, -1) if len(outs) > 1 else outs[0]

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        """The state names the dequantised weight (and bias), as an nn.Linear's."""
        destination[prefix + "weight"] = torch.cat([p.unpack()[0].dequantize().float()  # type: ignore[attr-defined]
                                                    for p in self.parts])
        if self.biases[0] is not None:
            destination[prefix + "bias"] = torch.cat([b for b in self.biases if b is not None])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, parts={self.bounds}, w8a8"


class W8A8Embedding(Int8Embedding):
    """A tied table as int8's (`quant.Int8Embedding`: rows dequantised on lookup) whose LM head product
    (`linear`) also quantises its input rows: the same int8 rows, packed for FBGEMM once more."""

    def __init__(self, weight: Rows) -> None:
        super().__init__(weight)
        self.packed = pack(self.q, self.scale)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.packed, self.num_embeddings)
