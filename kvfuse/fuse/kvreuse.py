"""Full KV reuse (PromptCache-style): the prefix and the re-rotated chunk caches as they are, then a
prefill of the suffix only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvfuse.fuse.core import IN_PLACE, FuseContext, Fused, FuseLayout, fuse_chunks
from kvfuse.fuse.registry import NoOptions, Reads, check_behind, register_fuser
from kvfuse.model import Decoder


def reuse(model: Decoder, layout: FuseLayout, ctx: FuseContext = IN_PLACE) -> Fused:
    """Full KV reuse: no chunk token is recomputed."""
    keep = [0] * model.cfg.num_layers
    return fuse_chunks(model, layout, keep, ctx=ctx)


@register_fuser
@dataclass(frozen=True, slots=True)
class Reuse(NoOptions):
    name: ClassVar[str] = "reuse"
    reads: ClassVar[Reads] = "chunks"
    exact: ClassVar[bool] = False
    takes_ratio: ClassVar[bool] = False
    behind: str = "bos"

    def __post_init__(self) -> None:
        check_behind(self.behind)

    def fuse(self, model: Decoder, layout: FuseLayout, ratio: float | None, ctx: FuseContext) -> Fused:
        return reuse(model, layout, ctx)
