"""The KV cache as an explicit value: slice, concatenate, copy, convert and count bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvfuse.config import ModelConfig

HOST = torch.device("cpu")  # where the store keeps caches, whatever device computes them


@contextmanager
def one_thread() -> Iterator[None]:
    """Run many small tensor copies on one thread. Each multithreaded op pays a thread-pool handoff; with
    hundreds of 16-token blocks and the other core busy (another request, another process) that cost
    reached milliseconds per copy on our 2-core machines: 0.03 s single-threaded against 5 s for 632
    blocks of a knowledge-base prefix."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@dataclass(frozen=True, slots=True)
class Residual:
    """The residual stream of a cache's tokens at one layer: `hidden` (T, hidden_size) is their input to
    layer `layer`, as the computation that made the cache had it. A chunk's cache may carry one, so that
    a fuser can resume the chunk's tokens there (`queryaware:skip=N`) instead of from their embeddings."""

    layer: int
    hidden: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.hidden.numel() * self.hidden.element_size()

    @staticmethod
    def read(residual_at: Callable[[int], torch.Tensor | None], layer: int | None) -> Residual | None:
        """A copy of a source's residual stream at that layer (`LayerSource.residual_at`, which may give
        a view of a file), as a value to keep; None when there is no layer or the source has none."""
        hidden = residual_at(layer) if layer is not None else None
        return Residual(layer, hidden.clone()) if layer is not None and hidden is not None else None


@dataclass(slots=True)
class KVCache:
    """Keys and values of T tokens on every layer.

    k, v:       (layers, kv_heads, T, head_dim); keys are stored rotated to `positions`
    positions:  (T,) int64, the absolute position each key was rotated to
    residual:   optionally, the tokens' residual stream at one layer (`Residual`)
    """

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    residual: Residual | None = None

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4 or self.k.shape[2] != self.positions.shape[0]:
            raise ValueError(f"inconsistent KV shapes k={tuple(self.k.shape)} v={tuple(self.v.shape)} "
                             f"positions={tuple(self.positions.shape)}")
        r = self.residual
        if r is not None and (r.hidden.dim() != 2 or r.hidden.shape[0] != self.k.shape[2]
                              or not 0 < r.layer < self.k.shape[0]):
            raise ValueError(f"a residual of shape {tuple(r.hidden.shape)} at layer {r.layer} does not fit "
                             f"a cache of {self.k.shape[2]} tokens and {self.k.shape[0]} layers")

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2 + (self.residual.nbytes if self.residual else 0)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> KVCache:
        shape = (cfg.num_layers, cfg.num_kv_heads, 0, cfg.head_dim)
        return cls(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype), torch.empty(0, dtype=torch.int64))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i, (kv_heads, T, head_dim) each (the LayerSource protocol)."""
        return self.k[i], self.v[i]

    def residual_at(self, layer: int) -> torch.Tensor | None:
        """(T, hidden_size) the tokens' input to that layer, if this cache carries it (the LayerSource
        protocol)."""
        r = self.residual
        return r.hidden if r is not None and r.layer == layer else None

    def slice(self, start: int, end: int) -> KVCache:
        """Tokens [start, end) as views (no copy)."""
        r = self.residual
        part = Residual(r.layer, r.hidden[start:end]) if r is not None else None
        return KVCache(self.k[:, :, start:end], self.v[:, :, start:end], self.positions[start:end], part)

    def clone(self, dtype: torch.dtype | None = None) -> KVCache:
        """A copy in tensors of its own (never views of a request's buffers), K, V and the residual in
        that dtype (None: as they are): one copy each, converting as it copies."""
        r = self.residual
        dtype = self.k.dtype if dtype is None else dtype
        return KVCache(self.k.to(dtype, copy=True), self.v.to(dtype, copy=True), self.positions.clone(),
                       Residual(r.layer, r.hidden.to(dtype, copy=True)) if r is not None else None)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> KVCache:
        """K, V and the residual in that dtype (None: as they are), every tensor on that device (None:
        where it is); the cache itself when nothing changes."""
        r = self.residual
        dtype = self.k.dtype if dtype is None else dtype
        dev = self.k.device if device is None else torch.device(device)
        same = dev == self.k.device and self.positions.device == dev
        if same and dtype == self.k.dtype and (r is None or (r.hidden.dtype == dtype and r.hidden.device == dev)):
            return self
        return KVCache(self.k.to(dev, dtype), self.v.to(dev, dtype), self.positions.to(dev),
                       Residual(r.layer, r.hidden.to(dev, dtype)) if r is not None else None)

    @staticmethod
    def concat(caches: list[KVCache]) -> KVCache:
        """Concatenate along tokens (one copy); the residual is kept where every part has it at one layer."""
        if not caches:
            raise ValueError("nothing to concatenate")
        if len(caches) == 1:
            return caches[0]
        rs = [c.residual for c in caches]
        layers = {r.layer for r in rs if r is not None}
        joined = Residual(layers.pop(), torch.cat([r.hidden for r in rs if r is not None])) \
            if all(r is not None for r in rs) and len(layers) == 1 else None
        return KVCache(
            torch.cat([c.k for c in caches], 2),
            torch.cat([c.v for c in caches], 2),
            torch.cat([c.positions for c in caches]),
            joined,
        )
