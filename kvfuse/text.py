"""The text edge: tokenizer, the deterministic prompt layout, and stop strings.

Prompt layout (every mode sees the same token ids):

    <bos> HEAD                         the fixed instruction head
    PREFIX_TEXT "\\n\\n"                 the prefix file, if one is given
    CHUNK_1 "\\n\\n" ... CHUNK_n "\\n\\n"   the chunks, in order
    "Question: " QUESTION "\\nAnswer:"    the suffix

Each segment is tokenised on its own, so a chunk's ids never depend on its neighbours and a chunk's
cache key is the same wherever it is retrieved. Segment text is stripped of surrounding whitespace.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfuse.engine import Request

HEAD = (
    "Answer the question using the passages below. Some questions need facts from more than one "
    "passage. Answer with a few words only.\n\n"
)
DEFAULT_STOP = ("\n",)


class Tokenizer:
    """A thin wrapper over the checkpoint's HF tokenizer (tokenizer.json)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(str(path))
        self.bos_id: int | None = self._tok.bos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids with the (start, end) character span of each in text."""
        enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        return str(self._tok.convert_ids_to_tokens(token_id))


@dataclass(frozen=True, slots=True)
class Prompt:
    head: str = HEAD
    prefix_text: str | None = None
    chunks: tuple[str, ...] = ()
    question: str = ""

    def request(self, tok: Tokenizer, prefix_mode: bool = False) -> Request:
        """Token ids by segment; with prefix_mode, everything before the question is the prefix."""
        head = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(self.head)
        if self.prefix_text is not None:
            head += tok.encode(self.prefix_text.strip() + "\n\n")
        chunks = [tuple(tok.encode(c.strip() + "\n\n")) for c in self.chunks]
        suffix = tuple(tok.encode(f"Question: {self.question.strip()}\nAnswer:"))
        if prefix_mode:
            return Request(prefix=tuple(head) + tuple(t for c in chunks for t in c), suffix=suffix)
        return Request(prefix=tuple(head), chunks=tuple(chunks), suffix=suffix)


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
    releases what was held back when the tokens end without a stop string."""

    def __init__(self, tok: Tokenizer, stops: Sequence[str] = DEFAULT_STOP) -> None:
        self.tok, self.stops = tok, stops
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
        cut = min((i for i in (text.find(s) for s in self.stops if s) if i >= 0), default=-1)
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
    tokens: Iterable[int], tok: Tokenizer, stops: Sequence[str] = DEFAULT_STOP
) -> Generator[str, None, None]:
    """Turn a token stream into text deltas, ending (and closing the stream) at the first stop string."""
    deltas = TextDeltas(tok, stops)
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


def complete_text(tokens: Iterable[int], tok: Tokenizer, stops: Sequence[str] = DEFAULT_STOP) -> str:
    return "".join(stream_text(tokens, tok, stops))


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A deterministic chat layout, tokenised turn by turn, so a conversation's request N is a token
    prefix of request N+1: an assistant turn starts with exactly the ids that asked for it.

    Gemma-style turn markers when the tokenizer has them, plain "Role:" lines otherwise. The system
    (and developer) message becomes its own turn; nothing is dropped or rewritten in earlier turns (the
    Qwen3 template strips earlier reasoning, which breaks the prefix property)."""

    open_turn: str = "<start_of_turn>{role}\n"
    close_turn: str = "<end_of_turn>\n"
    assistant_role: str = "model"
    stop_marker: str | None = "<end_of_turn>"
    stop_strings: tuple[str, ...] = ()  # where a reply ends when the model has no end-of-turn token
    system_turns: bool = False  # False: system text opens the first user turn (Gemma has no system role)
    content_prefix: str = ""  # between a turn's opening and its text

    @classmethod
    def for_tokenizer(cls, tok: Any) -> ChatTemplate:
        inner = getattr(tok, "_tok", None)
        vocab = inner.get_vocab() if inner is not None and hasattr(inner, "get_vocab") else {}
        if "<start_of_turn>" in vocab and "<end_of_turn>" in vocab:
            return cls()
        return cls(open_turn="{role}:", close_turn="\n", assistant_role="Assistant", stop_marker=None,
                   stop_strings=("\nUser:",), system_turns=True, content_prefix=" ")

    def role(self, role: str) -> str:
        if role == "assistant":
            return self.assistant_role
        if self.stop_marker is None:
            return role.capitalize()
        return role

    def turns(self, tok: Any, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The ids of finished turns (role, content), in order."""
        ids: list[int] = []
        pending: list[str] = []  # system text waiting for the next user turn
        for role, content in messages:
            if role in ("system", "developer") and not self.system_turns:
                pending.append(content)
                continue
            if role == "user" and pending:
                content = "\n\n".join(pending + [content])
                pending = []
            ids += self.generation_prompt(tok, role) + tok.encode(self.content_prefix + content)
            ids += tok.encode(self.close_turn)
        if pending:  # system text and no user turn after it: a user turn of its own
            ids += self.generation_prompt(tok, "user") + tok.encode(self.content_prefix + "\n\n".join(pending))
            ids += tok.encode(self.close_turn)
        return ids

    def generation_prompt(self, tok: Any, role: str = "assistant") -> list[int]:
        return list(tok.encode(self.open_turn.format(role=self.role(role))))
