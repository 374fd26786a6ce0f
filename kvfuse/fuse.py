"""Building a request's KV cache: full prefill, prefix reuse, full KV reuse and CacheBlend.

A request's prompt is  prefix | chunk_1 | ... | chunk_n | suffix.  Every builder returns a `Fused`:
the KV cache of the whole prompt at positions 0..T-1 and the logits of its last token.

- `prefill` is the naive path, and the oracle every other path is tested against.
- `reuse` places precomputed chunk caches after the prefix, re-rotating their keys to the new
  positions, and prefills only the suffix (PromptCache-style full KV reuse).
- `blend` is CacheBlend: it starts from the `reuse` cache, recomputes every chunk token on layer 0
  and, on later layers, only the tokens whose KV deviates most, chosen by gradual filtering.

Deviation measure. For a candidate token t on layer l we compute its fresh K and V from its fresh
hidden state and compare them with the reused (re-rotated) K and V:
    dev(t) = |K_new - K_old|^2 / mean_t |K_old|^2  +  |V_new - V_old|^2 / mean_t |V_old|^2
summed over kv heads. K and V are each normalised by their mean squared norm over the candidates
so that neither dominates: with q/k-norm (Gemma, Qwen3) keys have a fixed scale while values do not.

Filtering schedule. Layer 0 recomputes all chunk tokens. On layer l >= 1 the candidates are the
tokens recomputed on layer l-1 (only they have a fresh hidden state, so only their deviation can be
measured), and we keep the top fraction f_l = max(r, r ** (l / m)) of all chunk tokens, where r is
the ratio and m (`filter_layers`, default 2) is the number of layers over which the set shrinks to r.
The set only ever shrinks, so a token that keeps a high deviation over several layers is the one
that ends up recomputed everywhere; that agreement is what makes the choice more robust than one
layer's ranking (the seed's gradual filtering). m = 2 is cheap: on an 18-layer model at r = 0.15 the
chunk tokens cost (1 + 0.39 + 16 * 0.15) / 18 = 21% of a full prefill. Candidates that drop out on
layer l still get their fresh K and V written on layer l (they were computed to measure the
deviation, and are closer to full than the reused ones); from layer l+1 on they use the reused KV.

Recomputed tokens attend to every earlier key, reused or fresh, under the exact per-position causal
mask (and the sliding window of the layer), never a bottom-right-aligned approximation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvfuse.config import ModelConfig, RopeSpec
from kvfuse.kv import KVCache
from kvfuse.model import Decoder
from kvfuse.rope import rerotate

DEFAULT_RATIO = 0.15
DEFAULT_FILTER_LAYERS = 2

Rerotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, RopeSpec], torch.Tensor]


@dataclass(slots=True)
class Fused:
    cache: KVCache  # the whole prompt, positions 0..T-1
    logits: torch.Tensor  # (vocab,) float32, next-token logits after the last prompt token
    recomputed_token_layers: int = 0  # sum over layers of reused tokens that were recomputed
    selected: list[torch.Tensor] = field(default_factory=list)  # blend: chunk-token indices per layer


def _buffers(cfg: ModelConfig, total: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (cfg.num_layers, cfg.num_kv_heads, total, cfg.head_dim)  # (layers, kv_heads, T, head_dim)
    return torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)


def _run(model: Decoder, ids: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, start: int) -> torch.Tensor:
    """Prefill ids at positions start.. into the buffers after the keys already in [0, start); returns last hidden."""
    end = start + ids.shape[0]
    pos_all = torch.arange(end)
    pos = pos_all[start:]
    h = model.embed(ids)
    for i in range(model.cfg.num_layers):
        q, k, v = model.project(i, h, pos)
        k_buf[i, :, start:end], v_buf[i, :, start:end] = k, v
        a = model.attend(i, q, pos, k_buf[i, :, :end], v_buf[i, :, :end], pos_all)
        h = model.finish(i, h, a)
    return h[-1:]


def prefill(model: Decoder, ids: torch.Tensor, past: KVCache | None = None) -> Fused:
    """Full prefill of ids after an optional exact past cache (positions 0..len(past)-1)."""
    if ids.numel() == 0:
        raise ValueError("prefill needs at least one new token")
    start = len(past) if past is not None else 0
    end = start + ids.shape[0]
    dtype = past.dtype if past is not None else model.embed_tokens.weight.dtype
    k_buf, v_buf = _buffers(model.cfg, end, dtype)
    if past is not None:
        k_buf[:, :, :start], v_buf[:, :, :start] = past.k, past.v
    h = _run(model, ids, k_buf, v_buf, start)
    return Fused(KVCache(k_buf, v_buf, torch.arange(end)), model.logits(h)[0])


def precompute_chunk(
    model: Decoder, preamble: Sequence[int], chunk: Sequence[int], start: int | None = None
) -> KVCache:
    """KV of a chunk computed on its own behind the preamble; only the chunk's tokens are kept.

    The preamble sits at positions 0..len(preamble)-1 and the chunk at start.. (default: right after it).
    """
    pre = torch.tensor(list(preamble), dtype=torch.int64)
    ids = torch.tensor(list(chunk), dtype=torch.int64)
    if ids.numel() == 0:
        raise ValueError("a chunk needs at least one token")
    start = len(pre) if start is None else start
    if start < len(pre):
        raise ValueError("a chunk cannot start inside its preamble")
    pos = torch.cat((torch.arange(len(pre)), torch.arange(start, start + len(ids))))
    k_buf, v_buf = _buffers(model.cfg, len(pos), model.embed_tokens.weight.dtype)
    h = model.embed(torch.cat((pre, ids)))
    for i in range(model.cfg.num_layers):
        q, k, v = model.project(i, h, pos)
        k_buf[i], v_buf[i] = k, v
        h = model.finish(i, h, model.attend(i, q, pos, k, v, pos))
    n = len(pre)
    return KVCache(k_buf[:, :, n:].clone(), v_buf[:, :, n:].clone(), pos[n:].clone())


def _place_layer(
    cfg: ModelConfig,
    layer: int,
    chunks: Sequence[KVCache],
    start: int,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    rotate: Rerotate = rerotate,
) -> None:
    """Write layer `layer` of each chunk cache, keys re-rotated, back to back from position start."""
    at = start
    for c in chunks:
        n = len(c)
        target = torch.arange(at, at + n)
        k_out[:, at : at + n] = rotate(c.k[layer].to(k_out.dtype), c.positions, target, cfg.head_dim, cfg.rope(layer))
        v_out[:, at : at + n] = c.v[layer].to(v_out.dtype)
        at += n


def reuse(
    model: Decoder, prefix: KVCache, chunks: Sequence[KVCache], suffix: torch.Tensor, rotate: Rerotate = rerotate
) -> Fused:
    """Full KV reuse: prefix and re-rotated chunk caches as they are, then prefill only the suffix."""
    cfg = model.cfg
    p = len(prefix)
    n = p + sum(len(c) for c in chunks)
    k_buf, v_buf = _buffers(cfg, n + suffix.shape[0], prefix.dtype)
    k_buf[:, :, :p], v_buf[:, :, :p] = prefix.k, prefix.v
    for i in range(cfg.num_layers):
        _place_layer(cfg, i, chunks, p, k_buf[i], v_buf[i], rotate)
    h = _run(model, suffix, k_buf, v_buf, n)
    return Fused(KVCache(k_buf, v_buf, torch.arange(n + suffix.shape[0])), model.logits(h)[0])


def keep_schedule(num_layers: int, n: int, ratio: float, filter_layers: int = DEFAULT_FILTER_LAYERS) -> list[int]:
    """How many of n chunk tokens each layer recomputes: all on layer 0, then shrinking to ratio * n."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be between 0 and 1, got {ratio}")
    keep = [n]
    for layer in range(1, num_layers):
        frac = max(ratio, ratio ** min(1.0, layer / max(1, filter_layers))) if ratio > 0 else 0.0
        keep.append(min(keep[-1], math.ceil(frac * n - 1e-9)))
    return keep


def kv_deviation(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor:
    """Per-token KV deviation (T,) between fresh and reused K/V of shape (kv_heads, T, head_dim)."""
    def part(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        err = (new.float() - old.float()).pow(2).sum(dim=(0, 2))
        scale = old.float().pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-12)
        return err / scale

    return part(k_new, k_old) + part(v_new, v_old)


def blend(
    model: Decoder,
    prefix: KVCache,
    chunks: Sequence[KVCache],
    chunk_ids: Sequence[torch.Tensor],
    suffix: torch.Tensor,
    ratio: float = DEFAULT_RATIO,
    filter_layers: int = DEFAULT_FILTER_LAYERS,
    rotate: Rerotate = rerotate,
) -> Fused:
    """CacheBlend: fuse chunk caches after an exact prefix, recomputing the high-deviation tokens."""
    cfg = model.cfg
    if len(chunks) != len(chunk_ids) or any(len(c) != len(t) for c, t in zip(chunks, chunk_ids, strict=False)):
        raise ValueError("every chunk cache needs its token ids, of the same length")
    if suffix.numel() == 0:
        raise ValueError("blend needs a non-empty suffix")
    p = len(prefix)
    n_c = sum(len(c) for c in chunks)
    n = p + n_c
    total = n + suffix.shape[0]
    k_buf, v_buf = _buffers(cfg, total, prefix.dtype)
    k_buf[:, :, :p], v_buf[:, :, :p] = prefix.k, prefix.v
    pos_all = torch.arange(total)
    keep = keep_schedule(cfg.num_layers, n_c, ratio, filter_layers)

    # Rows being computed: the candidate chunk tokens (indices into the chunk span), then the suffix.
    cand = torch.arange(n_c)
    suffix_rows = torch.arange(n, total)
    ids = torch.cat([*chunk_ids, suffix]) if n_c else suffix
    h = model.embed(ids)
    selected: list[torch.Tensor] = []
    recomputed = 0
    for i in range(cfg.num_layers):
        _place_layer(cfg, i, chunks, p, k_buf[i], v_buf[i], rotate)
        rows = torch.cat((cand + p, suffix_rows))  # absolute positions of the rows in h
        q, k, v = model.project(i, h, rows)
        nc = cand.shape[0]
        if keep[i] < nc:
            dev = kv_deviation(k[:, :nc], v[:, :nc], k_buf[i][:, cand + p], v_buf[i][:, cand + p])
            top = torch.topk(dev, keep[i]).indices.sort().values
        else:
            top = torch.arange(nc)
        k_buf[i][:, rows], v_buf[i][:, rows] = k, v
        sel = torch.cat((top, torch.arange(nc, nc + suffix.shape[0])))
        a = model.attend(i, q[:, sel], rows[sel], k_buf[i], v_buf[i], pos_all)
        h = model.finish(i, h[sel], a)
        cand = cand[top]
        selected.append(cand)
        recomputed += int(cand.shape[0])
    return Fused(KVCache(k_buf, v_buf, pos_all), model.logits(h[-1:])[0], recomputed, selected)
