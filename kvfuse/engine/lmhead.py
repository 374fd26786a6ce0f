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

SAMPLED steps (temperature > 0, top_p 1) use the same bounds: every float32 logit l_j lies in
[a_j - s_j, a_j + s_j], so u_j = cap(a_j + s_j) + adj_j bounds the adjusted logit v_j = cap(l_j) + adj_j
(bias and penalties, added exactly) from above, and the largest cap(a_j - s_j) + adj_j bounds the top
from below. The tokens whose bound reaches within NEAR * T of that floor are computed exactly (their
rows of the float head); the rest keep their bounds. Rejection sampling: propose j with probability
proportional to exp(v_j / T) for a near token and exp(u_j / T) for a far one; keep a near token, keep a
far one with probability exp((v_j - u_j) / T) <= 1, else propose again. A kept token is distributed
exactly as exp(v_j / T), normalised: the distribution `sampling.sample` draws from. The screen's
bounds are loose (a few logits on Gemma 3), so this pays where the far tokens' bounds weigh little
against the near tokens' mass and the near tokens are few: at temperatures up to SAMPLE_MAX_T (on
Gemma 3 at 0.3 a median of 1,948 near tokens, at 0.7 17,529, at 1.0 74,041). Where the far bounds could
weigh more than MAX_REST of the near mass, or more than MAX_NEAR tokens are near, the step reads the
whole head instead, decided from the row's own numbers before any draw. The generator's draws differ
from `sample`'s, so a seeded request's tokens are not the full head's, but the same seed gives the same
tokens, alone or in a batch (each row is screened on its own).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvfuse import w8a8
from kvfuse.engine.sampling import SamplingParams, adjusted
from kvfuse.groups import GroupTable
from kvfuse.heap import return_freed_memory
from kvfuse.lowbit import LowBitTable
from kvfuse.quant import QUANT_ROWS, dequantize, int8_matmul, quantize_rows

log = logging.getLogger(__name__)

MARGIN = 1e-4  # relative, plus the same absolute: covers float32 rounding in the exact logits
SCREENS = ("w8a8", "int8pack")  # the screen's kernels, in order of preference (see the module docstring)
# The screen of a process that answers a few questions and exits (`Engine.load(decodes="few")`): torch's
# int8 kernel reads the rows as quantised, where FBGEMM first packs them (Gemma 3's head: 0.5-0.6 s to
# build against 2.6-2.9 s). Its steps cost 4-8 ms more, so it is the faster one up to about 250 tokens.
BRIEF_SCREEN = "int8pack"
NEAR = 12.0  # a sampled step computes exactly the tokens whose bound reaches within this (over T) of the top
MAX_REST = 0.1  # the most the far tokens' bounds may weigh against the near tokens' mass, else the whole head
MAX_NEAR = 8192  # the most rows computed exactly (3% of Gemma 3's vocabulary), else the whole head
SAMPLE_MAX_T = 0.5  # above this temperature the near tokens are too many on Gemma 3 (docs/benchmarks.md)


def _cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The model's final softcap (`Decoder.logits`), where it has one: monotonic, so bounds stay bounds."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def default_screen() -> str | None:
    if w8a8.available():
        return "w8a8"
    return "int8pack" if hasattr(torch, "_weight_int8pack_mm") else None


class GreedyHead:
    def __init__(self, weight: torch.Tensor | GroupTable | LowBitTable, kernel: str = "int8pack") -> None:
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
            self.q = self.q.new_empty((0, self.q.shape[1]))  # not a view of none, which would hold them all

    @classmethod
    def build(cls, weight: torch.Tensor | GroupTable | LowBitTable, kernel: str | None = None) -> GreedyHead | None:
        """The screen for a (vocab, hidden) head (on `kernel`, else the best one here), or None where this
        PyTorch cannot run one."""
        kernel = kernel or default_screen()
        if kernel is None or weight.dim() != 2:
            return None
        try:
            head = cls(weight, kernel)
            x = torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            want = int(torch.cat([F.linear(x[None], weight[at : at + QUANT_ROWS])[0]
                                  for at in range(0, weight.shape[0], QUANT_ROWS)]).argmax())
            if head.argmax(x) != want:
                raise RuntimeError("the int8 screen disagreed with the float32 head on a probe")
        except (RuntimeError, NotImplementedError) as e:
            log.warning("exact greedy screening unavailable (%s); decoding reads the float32 head", e)
            return None
        finally:
            return_freed_memory()  # the build's float blocks and FBGEMM's packing copies (Gemma 3: ~0.6 GB)
        return head

    def screen(self, xs: torch.Tensor) -> torch.Tensor:
        """The int8 screen's approximate logits (rows, vocab) in float32 for normed hidden states (rows, hidden)."""
        if self.packed is not None:
            return w8a8.matmul(xs.float(), self.packed, self.scale.shape[0])
        # torch's int8 kernel on the bfloat16-rounded rows; `int8_matmul` sums them in float32 instead where
        # the kernel cannot run (a width not a multiple of 16), closer than the bounds assume
        return int8_matmul(xs.to(torch.bfloat16).float(), self.q, self.scale)

    def _read(self, xf: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The input rows as the kernel reads them, and the kernel's relative output rounding."""
        if self.packed is not None:
            ints, s = w8a8.round_rows(xf)
            return ints * s, 2.0**-20
        return xf.to(torch.bfloat16).float(), 2.0**-8

    def bounds_rows(self, xs: torch.Tensor, approx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """For normed hidden states xs (rows, hidden): the screen's logits a and their slack s (rows, vocab
        each), such that every float32 logit l lies in [a - s, a + s]. One screen serves all rows: the
        int8 head is read once, and each row's numbers are its own (the input is rounded per row), so
        the bounds of some rows may be taken from a screen of more (`approx`: `screen(xs)`'s rows)."""
        approx = self.screen(xs) if approx is None else approx
        xf = xs.float()
        read, out_rounding = self._read(xf)
        x_norm = xf.norm(dim=1, keepdim=True)
        dx_norm = (xf - read).norm(dim=1, keepdim=True)
        slack = (self.err_norm + self.acc) * x_norm + self.row_norm * dx_norm
        return approx, slack + approx.abs() * (out_rounding + MARGIN) + MARGIN

    def candidates_rows(self, xs: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
                        allowed: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """For each normed hidden state in xs (rows, hidden): the indices of the rows of the head whose
        logit may be the largest (of the tokens `allowed[i]`, a (vocab,) bool mask, where given: the
        bounds hold for any subset, so a grammar's best token is screened as exactly)."""
        approx, slack = bounds if bounds is not None else self.bounds_rows(xs)
        low = approx - slack
        if allowed is not None and any(m is not None for m in allowed):
            low = low.clone()
            for i, m in enumerate(allowed):
                if m is not None:
                    low[i].masked_fill_(~m, float("-inf"))
        best_low = low.amax(dim=1, keepdim=True)
        within = approx + slack >= best_low
        if allowed is not None:
            for i, m in enumerate(allowed):
                if m is not None:
                    within[i] &= m
        return [row.nonzero()[:, 0] for row in within]

    def candidates(self, x: torch.Tensor) -> torch.Tensor:
        """Indices of the rows whose logit may be the largest, for one normed hidden state x (hidden,)."""
        return self.candidates_rows(x[None])[0]

    def argmax_rows(self, xs: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
                    allowed: Sequence[torch.Tensor | None] | None = None) -> list[int]:
        """For each normed hidden state in xs (rows, hidden), the index of its largest float32 logit
        (`bounds`: the rows' `bounds_rows`, where the caller has them; `allowed`: per row, the tokens
        it may choose from, or None for all)."""
        out = []
        for x, cand in zip(xs, self.candidates_rows(xs, bounds, allowed), strict=True):
            exact = F.linear(x[None], self.weight[cand])[0]
            out.append(int(cand[int(exact.argmax())]))
        return out

    def argmax(self, x: torch.Tensor) -> int:
        """The index of the largest float32 logit w_j . x, reading the float32 head only for candidates."""
        return self.argmax_rows(x[None])[0]

    def sample(self, x: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor], params: SamplingParams,
               generator: torch.Generator | None = None, generated: Sequence[int] = (),
               softcap: float | None = None) -> int | None:
        """A token drawn from exactly the distribution `sampling.sample` draws from with top_p 1 (the
        float32 logits, softcapped, adjusted, over the temperature), reading the float32 head only for
        the tokens that can matter. `bounds` are x's row of `bounds_rows`. None, before any draw, where
        the tokens left to their bounds could hold too much of the mass (a high temperature): then the
        caller reads the whole head. See SAMPLED in the module docstring."""
        approx, slack = bounds
        t = params.temperature
        adj = adjusted(torch.zeros_like(approx), params, generated)  # the bias and penalties, exactly added
        upper = (_cap(approx + slack, softcap) + adj) / t  # >= every token's adjusted logit over t
        floor = float(((_cap(approx - slack, softcap) + adj) / t).max())  # <= the largest one
        near = upper >= floor - NEAR  # the tokens computed exactly; the rest stay at their upper bounds
        cand = near.nonzero()[:, 0]
        if cand.numel() > MAX_NEAR:
            return None
        exact = (_cap(F.linear(x[None].float(), self.weight[cand].float())[0], softcap) + adj[cand]) / t
        rest = (~near).nonzero()[:, 0]
        if rest.numel() and float(torch.logsumexp(upper[rest], 0) - torch.logsumexp(exact, 0)) > math.log(MAX_REST):
            return None
        # propose from exact weights for the near tokens and upper bounds for the rest; a near token is
        # kept, a far one with probability exp(its exact value - its bound), else propose again
        weights = torch.softmax(torch.cat((exact, upper[rest])), dim=-1)
        while True:
            j = int(torch.multinomial(weights, 1, generator=generator))
            if j < cand.numel():
                return int(cand[j])
            tok = int(rest[j - cand.numel()])
            value = (_cap(F.linear(x[None].float(), self.weight[tok : tok + 1].float())[0], softcap)[0] + adj[tok]) / t
            if float(torch.rand(1, generator=generator)) < math.exp(min(0.0, float(value - upper[tok]))):
                return tok
