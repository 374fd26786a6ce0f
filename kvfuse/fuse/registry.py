"""The fuser registry: each way of building a request's cache is one class, registered by name.

A fuser says which caches it reads (`reads`): "nothing" (full prefill), "prefix" (the longest stored
run of prefix-and-chunk blocks) or "chunks" (an exact prefix, then each chunk's own cache). Whether it
is exact (always equals full prefill, so the load-time self-check does not gate it), whether it takes
a recompute ratio (and its default), what a spec's `@arg` means (`blend@0.15`, `legolink@16`), its
options (dataclass fields, set in a spec as `:OPTION=VALUE`) and what its chunk caches are computed
behind (`behind`, see BEHIND) are its own. Adding a
fusion method is one module with a `@register_fuser` class; the engine, the CLI's `--mode`, the
server's `kvfuse.mode` and the eval's method specs read the list from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import ClassVar, Literal, Protocol

from kvfuse import defaults
from kvfuse.config import ModelConfig
from kvfuse.fuse.core import FuseContext, Fused, FuseLayout
from kvfuse.model import Decoder

Reads = Literal["nothing", "prefix", "chunks"]
# What a chunk's cache is computed behind (its preamble, part of the chunk's key):
#   "bos"       the model's BOS alone (the engine's preamble): one cache per chunk, whatever the request;
#   "head"      the request's head, the first HEAD_PREAMBLE_MAX tokens of its prefix (the instruction
#               text, or a knowledge base's header and instructions): closer to what the chunk sees in a
#               full prefill; one cache per chunk and head;
#   "previous"  BOS, then the last NEIGHBOUR_TOKENS tokens before the chunk in this request (the head's
#               end for the first chunk, else the previous chunk's end): what a sliding-window layer sees
#               in a full prefill (FusionRAG's neighbour-conditioned precompute, with the request's own
#               neighbour); one cache per chunk and what precedes it, so reused only in the same order;
#   "self"      BOS, then the chunk's own tokens, repeated, up to NEIGHBOUR_TOKENS (ending with the chunk's
#               end): the chunk is computed as if deep inside a document, which a sliding-window layer
#               sees in a full prefill, and its cache still depends on the chunk alone.
BEHIND = ("bos", "head", "previous", "self")
HEAD_PREAMBLE_MAX = 128
NEIGHBOUR_TOKENS = 512  # the sliding window of Gemma 3 270M, which this was measured on




class Fuser(Protocol):
    name: ClassVar[str]
    reads: ClassVar[Reads]
    exact: ClassVar[bool]  # always equals full prefill
    takes_ratio: ClassVar[bool]  # recomputes a share of the chunk tokens: blend's ratio applies

    @property
    def default_ratio(self) -> float:
        """The ratio a request gets when it names none (fusers that take one)."""
        ...

    @property
    def behind(self) -> str:
        """What the chunk caches it reads are computed behind (see BEHIND)."""
        ...

    def fuse(self, model: Decoder, layout: FuseLayout, ratio: float | None, ctx: FuseContext) -> Fused: ...

    def label(self, ratio: float | str | None) -> str:
        """This fuser's name and `@arg` (`blend@0.15`, `legolink@16`); `spec_of` adds its other options."""
        ...

    @classmethod
    def from_arg(cls, arg: str | None) -> tuple[Fuser, float | str | None]:
        """The fuser and ratio a spec `NAME@ARG` names (ARG absent: None)."""
        ...


FUSERS: dict[str, type[Fuser]] = {}
DEFAULT_MODE = defaults.DEFAULT_MODE  # (where it is chosen, and why: `kvfuse/defaults.py`)


def check_behind(behind: str) -> None:
    if behind not in BEHIND:
        raise ValueError(f"behind must be one of {', '.join(BEHIND)}, got {behind!r}")


def chunk_preambles(fuser: Fuser, prefix: Sequence[int], chunks: Sequence[Sequence[int]],
                    bos: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """What each of a request's chunk caches is computed behind, for this fuser (see BEHIND)."""
    if fuser.behind == "head":
        return (tuple(prefix[:HEAD_PREAMBLE_MAX]),) * len(chunks)
    if fuser.behind == "previous":
        lead = tuple(bos)
        before = list(prefix[len(lead):] if tuple(prefix[: len(lead)]) == lead else prefix)
        out = []
        for c in chunks:
            out.append(lead + tuple(before[-NEIGHBOUR_TOKENS:]))
            before = list(c)
        return tuple(out)
    if fuser.behind == "self":
        return tuple(tuple(bos) + (tuple(c) * (NEIGHBOUR_TOKENS // max(1, len(c)) + 1))[-NEIGHBOUR_TOKENS:]
                     for c in chunks)
    return (tuple(bos),) * len(chunks)


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
    default_ratio: ClassVar[float] = 0.0  # takes no ratio

    def label(self, ratio: float | str | None) -> str:
        return self.name

    @classmethod
    def from_arg(cls, arg: str | None) -> tuple[Fuser, float | str | None]:
        no_arg(cls.name)(arg)
        return cls(), None  # type: ignore[return-value]


def parse_spec(spec: str) -> tuple[Fuser, float | str | None]:
    """A fuser and ratio from `NAME[@ARG][:OPTION=VALUE]...`: `blend@0.15`, `queryaware@0.2:behind=head`.

    ARG is the fuser's own (a ratio, legolink's head tokens); each option sets one of its fields."""
    head, *options = spec.split(":")
    name, at, arg = head.partition("@")
    fuser, ratio = _registered(name).from_arg(arg if at else None)
    return with_options(fuser, options), ratio


def parse_fuser(spec: str) -> Fuser:
    """A fuser with its default `@arg` from `NAME[:OPTION=VALUE]...` (`queryaware:behind=head`)."""
    name, *options = spec.split(":")
    if "@" in name:
        raise ValueError(f"{spec!r}: give the fuser and its options without an @argument")
    return with_options(_registered(name)(), options)


def _registered(name: str) -> type[Fuser]:
    cls = FUSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown fuser {name!r}; known: {', '.join(FUSERS)}")
    return cls


def with_options(fuser: Fuser, options: Sequence[str]) -> Fuser:
    """The fuser with some of its fields set from `OPTION=VALUE` strings (typed as the field's default)."""
    if not options:
        return fuser
    fields = {f.name: f for f in _fields(fuser)}
    changes: dict[str, object] = {}
    for item in options:
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            known = ", ".join(f"{k}=..." for k in fields) or "none"
            raise ValueError(f"{fuser.name}: unknown option {item!r}; its options: {known}")
        kind: Callable[[str], object] = type(fields[key].default)
        try:
            changes[key] = kind(value)
        except ValueError:
            raise ValueError(f"{fuser.name}: option {key} needs a {type(fields[key].default).__name__}, "
                             f"got {value!r}") from None
    return dataclasses.replace(fuser, **changes)  # type: ignore[type-var]


def spec_of(fuser: Fuser, ratio: float | str | None = None) -> str:
    """The spec `parse_spec` reads back as this fuser: its label, then every option not at its default
    (fields marked `metadata={"arg": True}` are in the label's @arg already)."""
    return fuser.label(ratio) + _options(fuser, defaults=False)


def for_model(fuser: Fuser, cfg: ModelConfig) -> Fuser:
    """The fuser with the options it leaves to the model ("auto") settled for this model's config, so
    that its curve key and the spec an answer reports name what ran. A fuser with such options has a
    `for_model(cfg)` method; the others are returned as they are."""
    settle = getattr(fuser, "for_model", None)
    return fuser if settle is None else settle(cfg)  # type: ignore[no-any-return]


def residual_layer(fuser: Fuser) -> int | None:
    """The layer whose residual stream the fuser's chunk caches must keep (`kv.Residual`), if any: a
    fuser that resumes chunk tokens mid-model has a `residual_layer` property; the others keep none."""
    layer = getattr(fuser, "residual_layer", None)
    return layer if isinstance(layer, int) else None


def fuser_key(fuser: Fuser) -> str:
    """The name a calibration curve is kept under: the label without a ratio and every option, defaults
    included (so a curve never silently applies to another fuser when a default changes)."""
    return fuser.label(None) + _options(fuser, defaults=True)


def _options(fuser: Fuser, defaults: bool) -> str:
    """`:OPTION=VALUE` for each field not in the label's @arg (metadata `arg`), those at their default
    only with `defaults`."""
    return "".join(f":{f.name}={getattr(fuser, f.name)}" for f in _fields(fuser)
                   if not f.metadata.get("arg") and (defaults or getattr(fuser, f.name) != f.default))


def _fields(fuser: Fuser) -> tuple[dataclasses.Field[object], ...]:
    return dataclasses.fields(fuser) if dataclasses.is_dataclass(fuser) else ()  # type: ignore[arg-type]


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


def default_mode(asked: str | None, chunks: bool) -> str:
    """The mode a request runs in: the one it asked for, else `DEFAULT_MODE` over chunks, else prefix
    (the longest stored run of its prefix, then the rest computed)."""
    return asked or (DEFAULT_MODE if chunks else "prefix")
