"""Log-probabilities in OpenAI's shapes (`logprobs` and `top_logprobs`), from the engine's per-token
`TokenLogprob`s: each the distribution the token was drawn from, after logit_bias and the penalties and
over the temperature (`sampling.logprob_of`; a greedy choice at temperature 1; top_p's cut not applied).

- chat: `choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}], "refusal": null}`;
- completions: `choices[].logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob}],
  text_offset}`.

A token's text is what it adds to the text before it (decoded over a few tokens of context, so a
SentencePiece or byte-level token keeps its leading space); `bytes` are that text's UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvfuse.request import TokenLogprob

CONTEXT = 6  # tokens decoded before one, so that its text is what it adds there


def count(logprobs: bool | int | None, top_logprobs: int | None, chat: bool) -> int | None:
    """How many alternatives a request asks for per token (None: no logprobs), or ValueError saying
    what to fix. Chat takes `logprobs: true` with `top_logprobs: 0..20`; completions take `logprobs:
    0..20`, the number of alternatives, as OpenAI's legacy API does."""
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise ValueError("in chat completions logprobs is true or false; top_logprobs says how many "
                             "alternatives (0 to 20)")
        if top_logprobs is not None and not logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        n = (top_logprobs or 0) if logprobs else None
    else:
        if isinstance(logprobs, bool) or top_logprobs is not None:
            raise ValueError("in completions logprobs is the number of alternatives per token (0 to 20); "
                             "top_logprobs belongs to chat completions")
        n = logprobs
    if n is not None and not 0 <= n <= 20:
        raise ValueError(f"{'top_logprobs' if chat else 'logprobs'} must be between 0 and 20, got {n}")
    return n


class _At:
    """One position: the last CONTEXT tokens before it, decoded once for the token and its alternatives."""

    def __init__(self, tok: Any, before: Sequence[int]) -> None:
        self.tok, self.ctx = tok, list(before[-CONTEXT:])
        self.head = tok.decode(self.ctx) if self.ctx else ""

    def piece(self, token: int) -> str:
        """What `token` adds to the text before it."""
        full = self.tok.decode([*self.ctx, token])
        return full[len(self.head) :] if full.startswith(self.head) else self.tok.decode([token])


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat(tok: Any, entries: Sequence[TokenLogprob], before: Sequence[int] = ()) -> dict[str, Any]:
    """The chat shape for these tokens, which follow `before` (the answer's earlier tokens)."""
    ids, content = list(before), []
    for e in entries:
        at = _At(tok, ids)
        text = at.piece(e.token)
        alts = []
        for t, v in e.top:
            alt = text if t == e.token else at.piece(t)
            alts.append({"token": alt, "logprob": v, "bytes": _bytes(alt)})
        content.append({"token": text, "logprob": e.logprob, "bytes": _bytes(text), "top_logprobs": alts})
        ids.append(e.token)
    return {"content": content, "refusal": None}


def completion(tok: Any, entries: Sequence[TokenLogprob], before: Sequence[int] = (),
               offset: int = 0) -> dict[str, Any]:
    """The completions shape for these tokens, which follow `before`; `offset` is where their text
    starts in the completion's text."""
    ids, tokens, offsets, tops = list(before), [], [], []
    for e in entries:
        at = _At(tok, ids)
        text = at.piece(e.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top: dict[str, float] = {}
        for t, v in e.top:
            top.setdefault(text if t == e.token else at.piece(t), v)
        tops.append(top)
        ids.append(e.token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}
