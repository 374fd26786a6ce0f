"""The exact fusers: `full` prefills everything (the oracle); `prefix` reads the longest stored run of
16-token blocks of prefix and chunks and prefills the rest (equal to full)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfuse.fuse.core import FuseContext, Fused, FuseLayout, prefill
from kvfuse.fuse.registry import NoOptions, Reads, register_fuser
from kvfuse.model import Decoder


@dataclass(frozen=True, slots=True)
class _Prefill(NoOptions):
    exact: ClassVar[bool] = True
    takes_ratio: ClassVar[bool] = False
    behind: ClassVar[str] = "bos"  # reads no chunk caches

    def fuse(self, model: Decoder, layout: FuseLayout, ratio: float | None, ctx: FuseContext) -> Fused:
        if layout.chunks:
            raise ValueError("an exact prefill reads no chunk caches; lay the chunks out as the prefix tail")
        return prefill(model, torch.cat((layout.prefix_tail, layout.suffix)), past=layout.prefix, room=ctx.room,
                       pause=ctx.pause)


@register_fuser
@dataclass(frozen=True, slots=True)
class Full(_Prefill):
    name: ClassVar[str] = "full"
    reads: ClassVar[Reads] = "nothing"


@register_fuser
@dataclass(frozen=True, slots=True)
class Prefix(_Prefill):
    name: ClassVar[str] = "prefix"
    reads: ClassVar[Reads] = "prefix"
