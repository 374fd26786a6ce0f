"""The load-time self-check of chunk fusion on a model: without it a wrong rotation or a broken
fusion would silently give worse answers, so inexact fusers are refused when it fails.

On a 40-token random probe: (1) blend at ratio 1.0 against full prefill (logits within 1e-3 relative in
float32; four rounding steps of bfloat16 where the model rounds to it, `precision.rounding`: bf16
kernels, and int8's, round differently by shape), and (2) re-rotated layer-0 keys against keys
computed at the target positions (a layer-0 key depends on its token alone, so these must agree; blend
at 1.0 alone would not catch a wrong rotation, since it overwrites every reused key).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfuse import fuse
from kvfuse.model import Decoder
from kvfuse.precision import rounding

TOLERANCE = 1e-3  # max |logit difference| relative to max |logit|, in float32


def tolerance(dtype: torch.dtype) -> float:
    """The self-check's relative tolerance for a model rounding to dtype (a wrong rotation is off by O(1))."""
    return max(TOLERANCE, 4 * torch.finfo(dtype).eps)


@torch.inference_mode()
def check_fusion(model: Decoder, preamble: Sequence[int], rotate: fuse.Rerotate) -> str | None:
    """None when fusion is exact on this model; else what failed, for the user."""
    cfg, tol = model.cfg, tolerance(rounding(model))
    g = torch.Generator().manual_seed(0)
    vocab = cfg.vocab_size

    def rand(n: int) -> tuple[int, ...]:
        return tuple(int(x) for x in torch.randint(min(4, vocab - 1), vocab, (n,), generator=g, device=g.device))

    prefix, chunks, suffix = tuple(preamble) + rand(3), (rand(9), rand(12), rand(7)), rand(4)
    ids = list(prefix) + [t for c in chunks for t in c] + list(suffix)
    full = fuse.prefill(model, torch.tensor(ids)).logits
    head = fuse.prefill(model, torch.tensor(prefix[:2])).cache  # the rest is computed as a tail
    caches = [fuse.precompute_chunk(model, preamble, c) for c in chunks]
    chunk_ids = [torch.tensor(c) for c in chunks]
    layout = fuse.FuseLayout.of(head, caches, torch.tensor(suffix), chunk_ids, torch.tensor(prefix[2:]))
    blended = fuse.blend(model, layout, 1.0, ctx=fuse.FuseContext(rotate)).logits
    err = float((blended - full).abs().max() / full.abs().max().clamp_min(1.0))
    chunk, target = caches[1], torch.arange(40, 40 + len(caches[1]))
    moved = torch.empty_like(chunk.k[0])
    rotate(moved, chunk.k[0], chunk.positions, target, cfg.head_dim, cfg.rope(0))
    _, direct, _ = model.project(0, model.embed(chunk_ids[1]), target)
    rot_err = float((moved - direct).abs().max() / direct.abs().max().clamp_min(1e-6))
    if rot_err > tol:
        return (
            f"self-check failed: re-rotated keys differ from keys computed at their new positions by "
            f"{rot_err:.2e} (relative) on this model, so the fusing modes are disabled; use 'full' or 'prefix'"
        )
    if err > tol:
        return (
            f"self-check failed: blend at ratio 1.0 differs from full prefill by {err:.2e} (relative, "
            f"tolerance {tol:.0e}) on this model, so the fusing modes are disabled; use 'full' or 'prefix'"
        )
    return None
