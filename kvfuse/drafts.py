"""Drafts from the context (prompt-lookup speculative decoding): the next tokens proposed from n-grams
of the request's own prompt and of what it has generated so far. Token ids and a table of keys only.

An answer over a knowledge base or retrieved passages copies spans of them (names, amounts, whole
quotes). When the last n tokens generated (n = 3, then 2, then 1) occurred before, the tokens that
followed their latest earlier occurrence are proposed as a draft; the engine verifies a draft in one
multi-row step (`decode.step_rows`) and keeps the longest prefix that decoding would have chosen
anyway (greedy, or sampled by the rejection rule: `Scheduler._verify`), plus the token that step chose
after it. A draft costs rows in that step, never a different answer.

A token is matched by its draft key (`token_keys`): its spelling without a leading space, so a copy
that begins at a line's start or after a quotation mark ("I was", "Duplicate") finds the same words where
the source has them after a space (" I was", " Duplicate"); the draft copies the source's tokens as
they are, and verification keeps only what decoding chooses.

`DraftLength` sizes the next draft from how the last one did (after HF's prompt-lookup heuristic: two
more after a draft taken whole, one fewer after a rejected one), so a request whose answer copies
nothing soon drafts little; and one whose drafts were taken whole `LONG_RUN` times in a row is copying
a span, so its drafts may grow past the usual length, to as many rows as a step carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_NGRAM = 3  # the longest suffix looked up; shorter ones are tried after it
DRAFT_TOKENS = 6  # a draft's usual longest (with the token fed, 7 rows); longer only in a run (`DraftLength`)
LONG_RUN = 2  # drafts taken whole in a row after which a request's drafts may grow past the usual length
SPACE_MARKS = ("\u2581", "\u0120")  # how SentencePiece ("▁") and byte-level BPE ("Ġ") spell a leading space
KEYS_RULE = 2  # the version of `token_keys`' rule: keys kept on disk by an older one are made again


def space_mark(pieces: Sequence[str | None]) -> str:
    """The mark this vocabulary spells a leading space with: whichever of `SPACE_MARKS` begins more of
    its pieces ("▁" on a tie). A SentencePiece vocabulary may also hold a piece that begins with a
    literal "Ġ", and a byte-level one with "▁"; those are letters there, not spaces."""
    counts = dict.fromkeys(SPACE_MARKS, 0)
    for piece in pieces:
        if piece and piece[0] in counts:
            counts[piece[0]] += 1
    return max(SPACE_MARKS, key=counts.__getitem__)


def token_keys(pieces: Sequence[str | None]) -> np.ndarray:
    """(len(pieces),) int64: each token's draft key, the lowest id spelled as it is without one leading
    space mark (the vocabulary's own, `space_mark`), so that "▁Duplicate" and "Duplicate" match. A
    token without a spelling (None) and a bare space mark are keyed by their own id."""
    mark = space_mark(pieces)
    keys = np.arange(len(pieces), dtype=np.int64)
    first: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        if not piece:
            continue
        bare = piece[1:] if piece[0] == mark and len(piece) > 1 else piece
        keys[i] = first.setdefault(bare, i)
    return keys


def cover(keys: np.ndarray, vocab_size: int) -> np.ndarray:
    """keys extended to a model's vocab_size ids: an id the vocabulary does not spell is its own key."""
    if len(keys) >= vocab_size:
        return keys
    return np.concatenate((keys, np.arange(len(keys), vocab_size, dtype=np.int64)))


def propose(context: np.ndarray, k: int, max_ngram: int = MAX_NGRAM, keys: np.ndarray | None = None) -> list[int]:
    """k tokens that followed the latest earlier occurrence of context's last n tokens (the longest
    n <= max_ngram that occurred before); [] when none did. context: (L,) int64 token ids; keys: (L,)
    their draft keys (`token_keys`), which the n-grams are matched on where given. Where what
    followed reaches the end of the context before k tokens, the copy goes on over what it copied (as
    LZ77's overlapping copy): a repeating pattern is drafted k tokens ahead, not only to the end of its
    last period."""
    n_ctx = len(context)
    if k <= 0 or n_ctx < 2:
        return []
    match = context if keys is None else keys
    for n in range(min(max_ngram, n_ctx - 1), 0, -1):
        key = match[n_ctx - n :]
        # starts i < n_ctx - n of windows equal to the key (the key itself, at n_ctx - n, is excluded)
        hit = match[: n_ctx - n] == key[0]
        for j in range(1, n):
            hit &= match[j : n_ctx - n + j] == key[j]
        starts = np.flatnonzero(hit)
        if len(starts):
            at = int(starts[-1]) + n  # the latest occurrence; the draft is what followed it
            draft = [int(t) for t in context[at : at + k]]
            period = n_ctx - at  # where what followed runs into the end, it goes on copying itself
            while len(draft) < k:
                draft.append(draft[len(draft) - period])
            return draft
    return []


class Context:
    """A request's prompt and generated tokens as one growing array, for `propose`, matched on their
    draft keys where the model's vocabulary gave a table of keys (`token_keys`)."""

    def __init__(self, prompt: Sequence[int], room: int, table: np.ndarray | None = None) -> None:
        self.ids = np.empty(len(prompt) + room, dtype=np.int64)
        self.ids[: len(prompt)] = prompt
        self.n = len(prompt)
        self.table = table

    def extend(self, tokens: Sequence[int]) -> None:
        if self.n + len(tokens) > len(self.ids):  # more than the room reserved: grow
            self.ids = np.concatenate((self.ids, np.empty(len(self.ids), dtype=np.int64)))
        self.ids[self.n : self.n + len(tokens)] = tokens
        self.n += len(tokens)

    @property
    def keys(self) -> np.ndarray | None:
        """The tokens' draft keys (a gather of the table: microseconds at 10k tokens), or None."""
        return None if self.table is None else self.table[self.ids[: self.n]]

    def propose(self, k: int) -> list[int]:
        return propose(self.ids[: self.n], k, keys=self.keys)


@dataclass(slots=True)
class DraftLength:
    """The next draft's length, from 1 to `most`, adapted to how the drafts of this request fare: two more
    after a draft taken whole, one fewer after a rejected one, within `usual` until `LONG_RUN` drafts in a
    row were taken whole. Such a request is copying a span of its context (a RAG answer copies a name or
    a sentence from a passage), so its drafts may then grow to `most`: each extra row costs a step a few
    milliseconds, each step saved a few tens (Gemma 3 270M at a 3.5k context: 42 ms a step of 7 rows,
    73 of 16, docs/benchmarks.md). A rejection ends the run and brings the length back within `usual`,
    so a request that drafts at its usual length and sees some drafts rejected never pays for long ones."""

    most: int = DRAFT_TOKENS
    now: int = DRAFT_TOKENS
    usual: int = DRAFT_TOKENS
    run: int = 0  # drafts taken whole in a row

    @property
    def copying(self) -> bool:
        """Whether the last `LONG_RUN` drafts were taken whole: the request copies a span of its context."""
        return self.run >= LONG_RUN

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.run += 1
            self.now = min(self.most if self.copying else min(self.usual, self.most), self.now + 2)
        else:
            self.run = 0
            self.now = max(1, min(self.now, self.usual) - 1)


@dataclass(slots=True)
class DraftStats:
    """What a request's drafts did: steps that verified one, tokens proposed, and tokens accepted."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None
