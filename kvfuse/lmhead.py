"""Exact greedy decoding over the LM head at a fraction of its memory traffic.

A greedy step needs only the argmax of the logits, and on a CPU the LM head is memory-bound: Gemma 3's
tied 262k x 640 float32 head is 671 MB, read in full for every token (about 40% of a decoding step).
`GreedyHead` reads an int8 copy instead (a quarter of the bytes) to *screen* the vocabulary, then
computes the float32 logits of the few rows that can still win and returns their argmax.

Why the choice equals the float32 argmax. With the head's rows w_j, their int8 dequantisation
w'_j = q_j * s_j (error e_j = w_j - w'_j) and the bfloat16 copy xb of the input x, the screen computes
a_j = round_bf16(w'_j . xb). Its distance to the float32 logit w_j . x is at most
    |e_j . x| + |w'_j . (x - xb)| + |a_j| 2^-8     <=     ||e_j|| ||x|| + ||w'_j|| ||x - xb|| + |a_j| 2^-8
(Cauchy-Schwarz, and bfloat16's relative rounding error 2^-9, doubled), plus the float32 accumulation
error of both products (hidden * 2^-24 * ||row|| ||x|| each) and a small margin. A token whose upper
bound falls below the best lower bound cannot be the argmax, so only the others (1 to 55 of 262,144 in
45 steps on MuSiQue prompts) are computed exactly, in float32.
A final softcap is monotonic, so it does not change the argmax and is skipped.

Two kernels can screen, and the bound follows the one used (`SCREENS`):
- `w8a8` (where PyTorch has FBGEMM, the default): the input row is rounded to integers on its own scale
  too, x_q = s round(x / s), and the products are summed exactly in int32 (`w8a8.py`), so
  a_j = w'_j . x_q up to two float32 roundings: the bound's input term is ||w'_j|| ||x - x_q||, and the
  output term |a_j| 2^-20. The input error is larger than bfloat16's, so more rows pass the screen
  (each is a 2.5 KB read), but the screen reads the int8 head at memory speed at any row count.
- `int8pack` (`torch._weight_int8pack_mm`, bfloat16 input and output): the bound above.
Where neither kernel exists or the screen fails its probe, `GreedyHead.build` returns None and
decoding keeps the plain float32 head.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvfuse import w8a8
from kvfuse.quant import QUANT_ROWS, dequantize, quantize_rows

log = logging.getLogger(__name__)

MARGIN = 1e-4  # relative, plus the same absolute: covers float32 rounding in the exact logits
SCREENS = ("w8a8", "int8pack")  # the screen's kernels, in order of preference (see the module docstring)


def default_screen() -> str | None:
    if w8a8.available():
        return "w8a8"
    return "int8pack" if hasattr(torch, "_weight_int8pack_mm") else None


class GreedyHead:
    def __init__(self, weight: torch.Tensor, kernel: str = "int8pack") -> None:
        if kernel not in SCREENS:
            raise ValueError(f"unknown screen kernel {kernel!r}; choose one of {', '.join(SCREENS)}")
        self.weight = weight  # (vocab, hidden): the exact head, read only for candidates
        self.kernel = kernel
        self.q, self.scale = quantize_rows(weight)  # the kernel's own rows and scales
        self.err_norm = torch.empty(weight.shape[0])  # ||e_j||
        self.row_norm = torch.empty(weight.shape[0])  # ||w'_j||
        for at in range(0, weight.shape[0], QUANT_ROWS):  # in blocks: no float copy of the whole table
            rows = slice(at, at + QUANT_ROWS)
            deq = dequantize(self.q[rows], self.scale[rows], torch.float32)  # w'_j, exactly as the kernel sees it
            self.err_norm[rows] = (weight[rows].detach().float() - deq).norm(dim=1)
            self.row_norm[rows] = deq.norm(dim=1)
        # float32 accumulation over `hidden` terms, in the screen and in the exact logits alike
        self.acc = 2 * weight.shape[1] * 2.0**-24 * (self.row_norm + self.err_norm)
        self.packed = None
        if kernel == "w8a8":  # FBGEMM's copy of the rows replaces them: the screen reads only it
            self.packed = w8a8.pack(self.q, self.scale)
            self.q = self.q[:0]

    @classmethod
    def build(cls, weight: torch.Tensor, kernel: str | None = None) -> GreedyHead | None:
        """The screen for a (vocab, hidden) head (on `kernel`, else the best one here), or None where this
        PyTorch cannot run one."""
        kernel = kernel or default_screen()
        if kernel is None or weight.dim() != 2:
            return None
        try:
            head = cls(weight, kernel)
            x = torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            want = int(F.linear(x[None], weight)[0].argmax())
            if head.argmax(x) != want:
                raise RuntimeError("the int8 screen disagreed with the float32 head on a probe")
        except (RuntimeError, NotImplementedError) as e:
            log.warning("exact greedy screening unavailable (%s); decoding reads the float32 head", e)
            return None
        return head

    def screen(self, xs: torch.Tensor) -> torch.Tensor:
        """The int8 screen's approximate logits (rows, vocab) in float32 for normed hidden states (rows, hidden)."""
        if self.packed is not None:
            return w8a8.matmul(xs.float(), self.packed, self.scale.shape[0])
        return torch._weight_int8pack_mm(xs.to(torch.bfloat16), self.q, self.scale).float()

    def _read(self, xf: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The input rows as the kernel reads them, and the kernel's relative output rounding."""
        if self.packed is not None:
            ints, s = w8a8.round_rows(xf)
            return ints * s, 2.0**-20
        return xf.to(torch.bfloat16).float(), 2.0**-8

    def candidates_rows(self, xs: torch.Tensor) -> list[torch.Tensor]:
        """For each normed hidden state in xs (rows, hidden): the indices of the rows of the head whose
        logit may be the largest. One screen serves all rows: the int8 head is read once."""
        approx = self.screen(xs)
        xf = xs.float()
        read, out_rounding = self._read(xf)
        x_norm = xf.norm(dim=1, keepdim=True)
        dx_norm = (xf - read).norm(dim=1, keepdim=True)
        slack = (self.err_norm + self.acc) * x_norm + self.row_norm * dx_norm
        slack = slack + approx.abs() * (out_rounding + MARGIN) + MARGIN
        best_low = (approx - slack).amax(dim=1, keepdim=True)
        return [row.nonzero()[:, 0] for row in approx + slack >= best_low]

    def candidates(self, x: torch.Tensor) -> torch.Tensor:
        """Indices of the rows whose logit may be the largest, for one normed hidden state x (hidden,)."""
        return self.candidates_rows(x[None])[0]

    def argmax_rows(self, xs: torch.Tensor) -> list[int]:
        """For each normed hidden state in xs (rows, hidden), the index of its largest float32 logit."""
        out = []
        for x, cand in zip(xs, self.candidates_rows(xs), strict=True):
            exact = F.linear(x[None], self.weight[cand])[0]
            out.append(int(cand[int(exact.argmax())]))
        return out

    def argmax(self, x: torch.Tensor) -> int:
        """The index of the largest float32 logit w_j . x, reading the float32 head only for candidates."""
        return self.argmax_rows(x[None])[0]
