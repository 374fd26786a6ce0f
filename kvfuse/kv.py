"""The KV cache as an explicit value: slice, concatenate, copy, convert and count bytes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvfuse.config import ModelConfig


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


@dataclass(slots=True)
class KVCache:
    """Keys and values of T tokens on every layer.

    k, v:       (layers, kv_heads, T, head_dim); keys are stored rotated to `positions`
    positions:  (T,) int64, the absolute position each key was rotated to
    """

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4 or self.k.shape[2] != self.positions.shape[0]:
            raise ValueError(f"inconsistent KV shapes k={tuple(self.k.shape)} v={tuple(self.v.shape)} "
                             f"positions={tuple(self.positions.shape)}")

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

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

    def slice(self, start: int, end: int) -> KVCache:
        """Tokens [start, end) as views (no copy)."""
        return KVCache(self.k[:, :, start:end], self.v[:, :, start:end], self.positions[start:end])

    def clone(self) -> KVCache:
        return KVCache(self.k.clone(), self.v.clone(), self.positions.clone())

    def to(self, dtype: torch.dtype) -> KVCache:
        if dtype == self.k.dtype:
            return self
        return KVCache(self.k.to(dtype), self.v.to(dtype), self.positions)

    @staticmethod
    def concat(caches: list[KVCache]) -> KVCache:
        """Concatenate along tokens (one copy)."""
        if not caches:
            raise ValueError("nothing to concatenate")
        if len(caches) == 1:
            return caches[0]
        return KVCache(
            torch.cat([c.k for c in caches], 2),
            torch.cat([c.v for c in caches], 2),
            torch.cat([c.positions for c in caches]),
        )
