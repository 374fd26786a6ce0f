"""Layer-wise loading of chunk caches, pipelined behind the recompute (the seed's fetch_kv / synchronize).

Blend reads layer i of every chunk only when it computes layer i, so layer i+1 can be read from disk
while layer i is being recomputed. `LayerLoader.fetch_kv(i)` starts reading layer i of all the
request's chunks in a background thread; `synchronize(i)` waits for it and returns the tensors. With
`pipelined=False` nothing is read ahead, which is the baseline the benchmark compares against.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch


class LayerSource(Protocol):
    """A chunk's cache that can be read one layer at a time (a KVCache in memory, a DiskEntry on disk)."""

    positions: torch.Tensor

    @property
    def nbytes(self) -> int: ...

    def __len__(self) -> int: ...
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def residual_at(self, layer: int) -> torch.Tensor | None:
        """(T, hidden_size) the chunk tokens' input to that layer, if the cache carries it (`kv.Residual`)."""
        ...


LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


class OnDevice:
    """A stored cache (host memory, a file) read onto the device that computes: its positions once, each
    layer when it is read (by the loader's thread, when pipelined), the residual stream when asked."""

    def __init__(self, source: LayerSource, device: torch.device) -> None:
        self.source, self.device = source, device
        self.positions = source.positions.to(device)

    @property
    def nbytes(self) -> int:
        return self.source.nbytes

    def __len__(self) -> int:
        return len(self.source)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.source.layer(i)
        return k.to(self.device), v.to(self.device)

    def residual_at(self, layer: int) -> torch.Tensor | None:
        hidden = self.source.residual_at(layer)
        return hidden.to(self.device) if hidden is not None else None


def on_device(source: LayerSource, device: torch.device) -> LayerSource:
    """The source itself where it already lives on that device, else read through `OnDevice`."""
    return source if source.positions.device == device else OnDevice(source, device)


def _lower_priority() -> None:
    """Run the loader below the compute threads. On a CPU machine the recompute keeps every core busy,
    and a loader at equal priority preempts the matmul threads, which then wait on each other at every
    parallel region; at lower priority it reads in the gaps and never stalls the recompute."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):
        pass


class LayerLoader:
    def __init__(self, sources: Sequence[LayerSource], num_layers: int, pipelined: bool = True) -> None:
        self.sources = list(sources)
        self.num_layers = num_layers
        self.pipelined = pipelined
        self._pending: dict[int, Future[LayerKV]] = {}
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="kvfuse-loader", initializer=_lower_priority)
            if pipelined
            else None
        )
        self.loaded: list[LayerKV] = []  # every layer read, in order (to promote the entries afterwards)

    def _read(self, i: int) -> LayerKV:
        return [s.layer(i) for s in self.sources]

    def fetch_kv(self, i: int) -> None:
        """Start reading layer i of every chunk (no-op past the last layer or when not pipelined)."""
        if self._pool is not None and i < self.num_layers and i not in self._pending:
            self._pending[i] = self._pool.submit(self._read, i)

    def synchronize(self, i: int) -> LayerKV:
        """Layer i of every chunk, waiting for its read to finish; starts the read of layer i+1."""
        fut = self._pending.pop(i, None)
        kv = fut.result() if fut is not None else self._read(i)
        self.fetch_kv(i + 1)
        self.loaded.append(kv)
        return kv

    def close(self) -> None:
        for fut in self._pending.values():
            fut.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> LayerLoader:
        self.fetch_kv(0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
