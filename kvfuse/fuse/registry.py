"""The fuser registry: each way of building a request's cache is one class, registered by name.

A fuser says which caches it reads (`reads`): "nothing" (full prefill), "prefix" (the longest stored
run of prefix-and-chunk blocks) or "chunks" (an exact prefix, then each chunk's own cache). Whether it
is exact (always equals full prefill, so the load-time self-check does not gate it), whether it takes
blend's ratio, and what a spec's `@arg` means (`blend@0.15`, `legolink@16`) are its own. Adding a
fusion method is one module with a `@register_fuser` class; the engine, the CLI's `--mode`, the
server's `kvfuse.mode` and the eval's method specs read the list from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

from kvfuse.fuse.core import Fused, FuseLayout, Rerotate
from kvfuse.loader import LayerLoader
from kvfuse.model import Decoder
from kvfuse.rope import rerotate_into

Reads = Literal["nothing", "prefix", "chunks"]


@dataclass(frozen=True, slots=True)
class FuseContext:
    """How a fuser runs, the same for every fuser: the key mover, the layer loader, decode room."""

    rotate: Rerotate = rerotate_into
    loader: LayerLoader | None = None
    room: int = 0


IN_PLACE = FuseContext()  # the default: rotate in place, read chunk layers as they are, no decode room


class Fuser(Protocol):
    name: ClassVar[str]
    reads: ClassVar[Reads]
    exact: ClassVar[bool]  # always equals full prefill
    takes_ratio: ClassVar[bool]  # recomputes a share of the chunk tokens: blend's ratio applies

    def fuse(self, model: Decoder, layout: FuseLayout, ratio: float | None, ctx: FuseContext) -> Fused: ...

    def label(self, ratio: float | str | None) -> str:
        """The spec that names this fuser with its options and ratio (`blend@0.15`, `legolink@16`)."""
        ...

    @classmethod
    def from_arg(cls, arg: str | None) -> tuple[Fuser, float | str | None]:
        """The fuser and ratio a spec `NAME@ARG` names (ARG absent: None)."""
        ...


FUSERS: dict[str, type[Fuser]] = {}
# The mode a request with chunks gets when it names none: `generate`, `ask --index`, the server, and the
# eval's `default` method. Still CacheBlend, the paper baseline, until issue G's measurements pick another.
DEFAULT_MODE = "blend"


def register_fuser(cls: type[Fuser]) -> type[Fuser]:
    FUSERS[cls.name] = cls
    return cls


def modes() -> tuple[str, ...]:
    """The registered fusers' names, in registration order."""
    return tuple(FUSERS)


def get_fuser(mode: str | Fuser) -> Fuser:
    """A fuser by name (with its default options), or the given one."""
    if not isinstance(mode, str):
        return mode
    cls = FUSERS.get(mode)
    if cls is None:
        raise KeyError(mode)
    return cls()


class NoOptions:
    """For a fuser with no options and no ratio: its label is its name, and a spec takes no @arg."""

    __slots__ = ()
    name: ClassVar[str]

    def label(self, ratio: float | str | None) -> str:
        return self.name

    @classmethod
    def from_arg(cls, arg: str | None) -> tuple[Fuser, float | str | None]:
        no_arg(cls.name)(arg)
        return cls(), None  # type: ignore[return-value]


def ratio_arg(name: str, arg: str | None) -> float | str:
    """The ratio of a spec `NAME@R` (R a number between 0 and 1, or auto), which the fuser requires."""
    from kvfuse.request import parse_ratio

    if arg is None:
        raise ValueError(f"{name} needs a ratio: {name}@0.15 or {name}@auto")
    try:
        return parse_ratio(arg)
    except ValueError as e:
        raise ValueError(f"{name}@{arg}: {e}") from None


def no_arg(name: str) -> Callable[[str | None], None]:
    def check(arg: str | None) -> None:
        if arg is not None:
            raise ValueError(f"{name!r} takes no @argument, got {name}@{arg}")

    return check
