"""A request's K and V buffers, kept for the next request once nothing reads them (`BufferPool`).

A prompt's buffers are large (a 10k-token prompt of Gemma 3 270M: 187 MB each for K and V in float32),
and on the CPU a new one costs its first writes in page faults: copying a knowledge base's 632 stored
blocks into new buffers took 176 ms, into buffers already mapped 28 ms (docs/benchmarks.md, stop 50).
So buffers go back to a pool when the last tensor that views them is gone, and the next prompt takes
them instead of new ones.

A buffer also remembers the stored blocks copied into its first positions (`held`: weak references to
their very K and V tensors, so a block that was evicted, or a converted copy made for one request,
matches nothing and is not kept alive). Every writer
of a pooled buffer writes only after the blocks it copied in (a prefill computes its new tokens after
its past, a fuser places chunks after the exact prefix, decoding appends), so those positions still
hold the blocks when the buffer comes back. A prompt that starts with the same blocks (the next
question on a cached knowledge base, whose blocks the memory tier returns as the same objects) skips
copying them: its prefix is already in place.

Kept buffers and their views are made outside inference mode, so that a request run in it and one run
outside it may both write them. A buffer counts as free when its storage is referenced by the pool's
own tensor alone (PyTorch's use count of the storage; where a PyTorch lacks it, or off the CPU, no
buffer is kept). Buffers are handed out as views, so every reader adds to that count until it lets go.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfuse.kv import KVCache

KEEP = 4  # buffers kept at most (busy or free)


COUNTS = hasattr(torch._C, "_storage_Use_Count")  # without it no buffer is kept


def _use_count(t: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def _pair(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)


Held = tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]  # a block's K and V, not kept alive


def _held(c: KVCache) -> Held:
    return weakref.ref(c.k), weakref.ref(c.v)


@dataclass(eq=False, slots=True)
class _Entry:
    k: torch.Tensor
    v: torch.Tensor
    held: tuple[Held, ...] = ()  # the blocks at its first positions, in order

    def free(self) -> bool:
        # the pool's tensor and the storage object made to ask: nobody else holds a view
        return _use_count(self.k) == 2 and _use_count(self.v) == 2

    def matching(self, parts: Sequence[KVCache]) -> int:
        n = 0
        for (k, v), want in zip(self.held, parts, strict=False):
            if k() is not want.k or v() is not want.v:
                break
            n += 1
        return n


@dataclass(slots=True)
class Lease:
    """Buffers of exactly the asked shape (views), and how many of the asked blocks they already hold at
    their start; `holds` records the blocks once the caller has copied the rest in."""

    k: torch.Tensor
    v: torch.Tensor
    done: int
    entry: _Entry | None

    def holds(self, parts: Sequence[KVCache]) -> None:
        if self.entry is not None:
            self.entry.held = tuple(_held(c) for c in parts)


class BufferPool:
    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
             parts: Sequence[KVCache] = ()) -> Lease:
        """K and V buffers of `shape` (layers, kv_heads, positions, head_dim): a free kept pair with room
        enough, the one already holding most of `parts` first, then one that holds nothing, else new."""
        if device.type != "cpu" or self.keep <= 0 or not COUNTS:
            return Lease(*_pair(shape, dtype, device), 0, None)
        with self._lock, torch.inference_mode(False):  # normal tensors: written in and out of inference mode
            fits = [e for e in self._entries
                    if e.k.dtype == dtype and e.k.shape[:2] == shape[:2] and e.k.shape[3] == shape[3]
                    and e.k.shape[2] >= shape[2] and e.free()]
            entry = max(fits, key=lambda e: (e.matching(parts), not e.held, -e.k.shape[2]), default=None)
            if entry is None or (not entry.matching(parts) and entry.held and len(self._entries) < self.keep):
                entry = self._new(shape, dtype)
            done = entry.matching(parts) if entry is not None else 0
            if entry is None:  # every kept pair is busy and the pool is full: a pair of its own
                return Lease(*_pair(shape, dtype), 0, None)
            entry.held = entry.held[:done]  # the rest is about to be overwritten
            n = shape[2]
            return Lease(entry.k[:, :, :n], entry.v[:, :, :n], done, entry)

    def _new(self, shape: tuple[int, int, int, int], dtype: torch.dtype) -> _Entry | None:
        """A new kept pair, once the free pairs too small for it are let go (their memory is needed
        more than their contents); None when every kept pair is busy."""
        free = sorted((e for e in self._entries if e.free()), key=lambda e: e.k.shape[2] >= shape[2])
        for e in free:  # the too small first, then others while the pool is full
            if e.k.shape[2] < shape[2] or len(self._entries) >= self.keep:
                self._entries.remove(e)
        if len(self._entries) >= self.keep:
            return None
        entry = _Entry(*_pair(shape, dtype))
        self._entries.append(entry)
        return entry

    def clear(self) -> None:
        with self._lock:
            self._entries = []


POOL = BufferPool()
