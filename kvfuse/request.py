"""What a request is and what it returns: token ids in, a Generation out. No text, no model.

A request is  prefix | chunks | suffix:
- the prefix is cacheable as a prefix: its full blocks are stored under chained block hashes;
- each chunk is cacheable on its own, computed behind a fixed preamble (BOS) that is part of its key;
- the suffix (the question) is never cached.

Who may read a cache entry is a `Salt` (knowledge base, group, tenant), rendered into a store key in
exactly one place, `Salt.key`, so the CLI, the library and the server give one tenant one set of keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from kvfuse.drafts import DraftStats
from kvfuse.store.keys import SaltRange
from kvfuse.store.tiered import StoreStats

if TYPE_CHECKING:
    from kvfuse.policy import Decision

Ratio = float | str | None  # a number in [0, 1], "auto" (the controller decides) or None (the default)
OPEN_END = 1 << 62  # a salt span that runs to the end of the request, however long it grows


class RequestError(ValueError):
    """The request cannot be run as given; the message says what to change."""


class ModeUnavailableError(RuntimeError):
    """This model failed the load-time self-check, so chunk reuse (reuse, blend, ...) is refused."""


def parse_ratio(text: str) -> float | str:
    """A ratio as users write it: a number between 0 and 1, or 'auto'; ValueError says what is wrong."""
    if text == "auto":
        return text
    try:
        r = float(text)
    except ValueError:
        raise ValueError(f"the ratio must be a number between 0 and 1 or 'auto', got {text!r}") from None
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"the ratio must be between 0 and 1, got {text}")
    return r


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A chosen token's log-probability and the most likely alternatives', as (token id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Salt:
    """Whose cache entries these are: a knowledge base's group, a tenant, or both. Unsalted entries
    (no Salt at all) are shared by everyone who sends the same tokens."""

    kb: str | None = None
    group: str | None = None
    tenant: str | None = None

    @classmethod
    def of_owner(cls, tenant: str | None, group: str | None, kb: str | None = None,
                 tenant_wide: bool = False) -> Salt | None:
        """The salt of everything a request brings (its documents, chat turns, plain prompt): its tenant
        and the group it reads as (of kb, if any), so no other group of the tenant reads its entries;
        tenant-wide where the operator opted in. None without a tenant (no keys: one shared cache)."""
        if not tenant:
            return None
        return cls(tenant=tenant) if tenant_wide else cls(kb=kb, group=group, tenant=tenant)

    @property
    def key(self) -> str:
        """The one rendering of a salt into a store key: 'kb:NAME/group:G', 'tenant:T', ..."""
        parts = [f"{name}:{value}" for name, value in (("kb", self.kb), ("group", self.group),
                                                        ("tenant", self.tenant)) if value is not None]
        if not parts:
            raise ValueError("an empty salt has no key; use no salt instead")
        return "/".join(parts)


@dataclass(frozen=True, slots=True)
class SaltSpan:
    """A salt for the prefix blocks that overlap tokens [start, end)."""

    start: int
    end: int
    salt: Salt

    @property
    def range(self) -> SaltRange:
        """The span as the store's key range."""
        return SaltRange(self.start, self.end, self.salt.key)


@dataclass(frozen=True, slots=True)
class Request:
    suffix: tuple[int, ...]
    prefix: tuple[int, ...] = ()
    chunks: tuple[tuple[int, ...], ...] = ()
    salts: tuple[SaltSpan, ...] = ()  # salts of the prefix blocks over given token ranges (groups, tenants)
    chunk_salt: Salt | None = None  # the salt of every chunk cache of this request (a tenant's own documents)

    @property
    def ids(self) -> list[int]:
        out = list(self.prefix)
        for c in self.chunks:
            out.extend(c)
        return out + list(self.suffix)

    @property
    def chunk_tokens(self) -> int:
        return sum(len(c) for c in self.chunks)

    def __len__(self) -> int:
        return len(self.prefix) + self.chunk_tokens + len(self.suffix)


def owned_request(head: Sequence[int], suffix: Sequence[int], *, after: Sequence[int] = (),
                  chunks: Sequence[Sequence[int]] = (), owner: Salt | None = None,
                  head_salts: Sequence[SaltSpan] = ()) -> Request:
    """The one way a request is put together from token ids, with a knowledge base or without: a head
    (BOS, or a knowledge base's prefix with its own salts), what the request brings after it (a chat's
    earlier turns, then its documents as chunks, then the suffix), and the request's owner's salt over
    everything it brought (`Salt.of_owner`)."""
    salts = tuple(head_salts) + ((SaltSpan(len(head), OPEN_END, owner),) if owner else ())
    return Request(suffix=tuple(suffix), prefix=tuple(head) + tuple(after), chunks=tuple(tuple(c) for c in chunks),
                   salts=salts, chunk_salt=owner)


@dataclass(slots=True)
class TokenCounts:
    """prompt = prefilled + reused. recomputed counts reused tokens recomputed, in full-layer equivalents.

    cached counts the tokens whose KV was read from the store and used as read: reused tokens of
    prefix blocks and chunk caches that were hits, less their recomputed share (a chunk computed on
    a miss during this request is reused, but not cached)."""

    prompt: int = 0
    prefilled: int = 0
    reused: int = 0
    recomputed: int = 0
    cached: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class Generation:
    tokens: list[int]
    ttft_s: float
    total_s: float
    counts: TokenCounts
    logits_of_prompt: Callable[[], torch.Tensor]  # `first_logits`, computed when first asked for
    finish_reason: str  # "stop" (EOS or stop id) or "length"
    mode: str
    ratio: float | None
    store: StoreStats = field(default_factory=StoreStats)  # this request's lookups
    controller: Decision | None = None  # the ratio and tier decision, when a controller is set
    step_logits: torch.Tensor | None = None  # (steps, vocab) logits that chose each token, if recorded
    scored_logits: torch.Tensor | None = None  # (len(score), vocab) teacher-forced logits, if asked
    fuser: str = ""  # the fuser with its options (`fuse.spec_of`: queryaware:behind=self); mode is its name
    drafts: DraftStats = field(default_factory=DraftStats)  # drafts from the context (`drafts.py`)
    logprobs: list[TokenLogprob] | None = None  # per token, where asked (`SamplingParams.logprobs`)

    @property
    def first_logits(self) -> torch.Tensor:
        """(vocab,) float32 logits of the first token. A greedy request chose its first token without
        them (through the int8 screen of the head), so they are computed on first use."""
        return self.logits_of_prompt()

    def first_token_top(self, k: int = 20) -> list[tuple[int, float]]:
        """The k most likely first tokens as (token_id, logprob)."""
        lp = torch.log_softmax(self.first_logits.float(), -1)
        top = torch.topk(lp, k)
        return [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=False)]
