"""Rotary position embeddings as pure functions.

Convention: HF's half-split layout. A head vector x of size D is split into halves (x1, x2) and
rotated as (x1 cos - x2 sin, x2 cos + x1 sin) with frequencies repeated over both halves. Every
RoPE variant kvfuse supports is a pure rotation, so rotating by a then by b equals rotating by a+b;
that is what lets a cached key be moved to a new position (`rerotate`).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from kvfuse.config import RopeSpec


@lru_cache(maxsize=64)
def inv_freq(head_dim: int, spec: RopeSpec, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies, shape (head_dim // 2,), float32, with the spec's scaling applied, on the
    device (None: the CPU, where they are always computed).

    Cached per (head_dim, spec, device): every layer of every decoding step asks for it. Do not modify it."""
    if device is not None and device.type != "cpu":
        return inv_freq(head_dim, spec).to(device)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    freq = 1.0 / (spec.base**exponents)
    if spec.kind == "linear":
        return freq / spec.factor
    if spec.kind == "llama3":
        low_wavelen = spec.original_max_position / spec.low_freq_factor
        high_wavelen = spec.original_max_position / spec.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / spec.factor, freq)
        smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (
            spec.high_freq_factor - spec.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return freq


def rope_cos_sin(positions: torch.Tensor, head_dim: int, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for integer positions (T,), each of shape (T, head_dim), float32."""
    freq = inv_freq(head_dim, spec, positions.device if positions.device.type != "cpu" else None)
    angles = positions.to(torch.float32)[:, None] * freq[None, :]  # (T, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, D)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: `rotate` multiplies x's halves swapped by it."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor) -> torch.Tensor:
    """`apply_rope(x, cos, sin)` given ssin = signed_sin(sin), bit for bit (-a * b is a * -b exactly), in
    four operator calls instead of seven: what every layer of a decoding step runs for q and k."""
    half = x.shape[-1] // 2
    if x.dtype == cos.dtype:
        return (x * cos) + (x.roll(half, -1) * ssin)
    xf = x.float()
    return ((xf * cos.float()) + (xf.roll(half, -1) * ssin.float())).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., T, D) by per-position cos/sin (T, D); a low-precision x is rotated in float32 and
    rounded once (bfloat16 cos and sin would be off by a degree at a few thousand positions)."""
    if x.dtype == cos.dtype:
        return (x * cos) + (_rotate_half(x) * sin)
    xf = x.float()
    return ((xf * cos.float()) + (_rotate_half(xf) * sin.float())).to(x.dtype)


def _shift(
    from_pos: torch.Tensor, to_pos: torch.Tensor, head_dim: int, spec: RopeSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation that moves keys from from_pos to to_pos: (T, D), or (1, D) when
    every key moves by the same amount (a chunk moved as a whole)."""
    delta = to_pos.to(torch.int64) - from_pos.to(torch.int64)
    if bool((delta == delta[0]).all()):
        delta = delta[:1]
    return rope_cos_sin(delta, head_dim, spec)


def rerotate(
    k: torch.Tensor, from_pos: torch.Tensor, to_pos: torch.Tensor, head_dim: int, spec: RopeSpec
) -> torch.Tensor:
    """Move keys k (..., T, D) that were rotated at from_pos (T,) to to_pos (T,)."""
    if torch.equal(from_pos.to(torch.int64), to_pos.to(torch.int64)):
        return k
    return apply_rope(k, *_shift(from_pos, to_pos, head_dim, spec))


def rerotate_into(
    out: torch.Tensor, k: torch.Tensor, from_pos: torch.Tensor, to_pos: torch.Tensor, head_dim: int, spec: RopeSpec
) -> None:
    """`rerotate(k, ...)` written straight into out (same shape as k, not overlapping it), with no
    temporaries: placing chunk caches does this for every chunk on every layer, where allocating fresh
    tensors (and faulting their pages in) cost more than the arithmetic."""
    cos, sin = _shift(from_pos, to_pos, head_dim, spec)
    half = head_dim // 2
    c, s = cos[:, :half], sin[:, :half]  # both halves share the frequencies
    k1, k2, o1, o2 = k[..., :half], k[..., half:], out[..., :half], out[..., half:]
    torch.mul(k1, c, out=o1)
    o1.addcmul_(k2, s, value=-1)  # x1 cos - x2 sin
    torch.mul(k2, c, out=o2)
    o2.addcmul_(k1, s)  # x2 cos + x1 sin
