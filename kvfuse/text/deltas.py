"""Token ids in, text out: text deltas that end at the first stop string, held back until decided."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

DEFAULT_STOP = ("\n",)


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


def _held(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of text that is a proper start of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                best = max(best, n)
                break
    return best


class TextDeltas:
    """Token ids in, text deltas out, one token at a time, ending at the first stop string.

    Text that could still turn into a stop string is held back until it is decided. `push` returns
    the text a token released (often ""); once `stopped` is set, further tokens are ignored; `flush`
    releases what was held back when the tokens end without a stop string.

    With `lead_in`, whitespace before the first visible character is a lead-in, not the end: a stop
    string counts only from there on (an answer that starts with a newline is kept, not cut to "")."""

    def __init__(self, tok: Decoder, stops: Sequence[str] = DEFAULT_STOP, lead_in: bool = False) -> None:
        self.tok, self.stops, self.lead_in = tok, stops, lead_in
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def push(self, t: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(t)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
            return ""
        return self._cut(text, len(text) - _held(text, self.stops))

    def flush(self) -> str:
        return "" if self.stopped else self._cut(self.tok.decode(self.ids), None)

    def _cut(self, text: str, upto: int | None) -> str:
        """Release text up to `upto` (None: all of it), or up to the first stop string in it."""
        start = len(text) - len(text.lstrip()) if self.lead_in else 0
        cut = min((i for i in (text.find(s, start) for s in self.stops if s) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(text, cut)
        return self._release(text, upto)

    def _release(self, text: str, upto: int | None) -> str:
        end = len(text) if upto is None else upto
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent : end], end
        return out


def stream_text(
    tokens: Iterable[int], tok: Decoder, stops: Sequence[str] = DEFAULT_STOP, deltas: TextDeltas | None = None
) -> Generator[str, None, None]:
    """Turn a token stream into text deltas, ending (and closing the stream) at the first stop string."""
    deltas = deltas if deltas is not None else TextDeltas(tok, stops)
    it = iter(tokens)
    try:
        for t in it:
            if d := deltas.push(t):
                yield d
            if deltas.stopped:
                return
        if d := deltas.flush():
            yield d
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def complete_text(tokens: Iterable[int], tok: Decoder, stops: Sequence[str] = DEFAULT_STOP) -> str:
    return "".join(stream_text(tokens, tok, stops))


@dataclass(frozen=True, slots=True)
class Completed:
    text: str  # stripped
    stopped: bool  # a stop string ended it (not the token limit, not a stop token)


def complete_answer(tokens: Iterable[int], tok: Decoder, stops: Sequence[str] = DEFAULT_STOP) -> Completed:
    """An answer's text: leading whitespace is a lead-in (see TextDeltas), and the text is stripped."""
    deltas = TextDeltas(tok, stops, lead_in=True)
    text = "".join(stream_text(tokens, tok, stops, deltas))
    return Completed(text.strip(), deltas.stopped)
