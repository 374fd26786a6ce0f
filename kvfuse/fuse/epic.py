"""EPIC's LegoLink baseline: recompute the first `head_tokens` of every chunk on every layer, with no
deviation measure (after a precompute behind BOS the chunk-start tokens behave like attention sinks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvfuse.fuse.core import IN_PLACE, FuseContext, Fused, FuseLayout, fuse_chunks
from kvfuse.fuse.registry import Fuser, Reads, check_behind, register_fuser
from kvfuse.model import Decoder

DEFAULT_HEAD_TOKENS = 16


def legolink(model: Decoder, layout: FuseLayout, head_tokens: int = DEFAULT_HEAD_TOKENS,
             ctx: FuseContext = IN_PLACE) -> Fused:
    """Recompute the first head_tokens of every chunk on every layer."""
    if head_tokens < 0:
        raise ValueError(f"head_tokens must be >= 0, got {head_tokens}")
    heads = [torch.arange(at, at + min(head_tokens, len(c))) for at, c in zip(layout.chunk_starts(), layout.chunks,
                                                                              strict=True)]
    fixed = torch.cat(heads) if heads else torch.empty(0, dtype=torch.int64)
    keep = [int(fixed.shape[0])] * model.cfg.num_layers
    return fuse_chunks(model, layout, keep, candidates=fixed, ctx=ctx)


@register_fuser
@dataclass(frozen=True, slots=True)
class Legolink:
    name: ClassVar[str] = "legolink"
    reads: ClassVar[Reads] = "chunks"
    exact: ClassVar[bool] = False
    takes_ratio: ClassVar[bool] = False
    default_ratio: ClassVar[float] = 0.0  # takes no ratio
    head_tokens: int = field(default=DEFAULT_HEAD_TOKENS, metadata={"arg": True})  # legolink@K
    behind: str = "bos"

    def __post_init__(self) -> None:
        check_behind(self.behind)

    def fuse(self, model: Decoder, layout: FuseLayout, ratio: float | None, ctx: FuseContext) -> Fused:
        return legolink(model, layout, self.head_tokens, ctx)

    def label(self, ratio: float | str | None) -> str:
        return f"{self.name}@{self.head_tokens}"

    @classmethod
    def from_arg(cls, arg: str | None) -> tuple[Fuser, float | str | None]:
        if arg is None:
            return cls(), None
        try:
            k = int(arg)
        except ValueError:
            raise ValueError(f"legolink@{arg}: expected a whole number of tokens") from None
        if k < 0:
            raise ValueError(f"legolink@{arg}: must be >= 0")
        return cls(k), None
