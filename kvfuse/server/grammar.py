"""Structured answers (`response_format`): a JSON schema, or any JSON object, compiled by llguidance
(chosen over xgrammar: a small wheel with no torch of its own, one Rust call per mask, about 0.3 ms for
Gemma 3's 262k tokens) into a grammar over the model's tokens, and given to the engine as a
`sampling.TokenConstraint`: before each token the engine masks every token the grammar forbids, and
the answer ends when the grammar is complete. A greedy request with a grammar is screened among the
tokens it allows (`GreedyHead.argmax_rows(allowed=)`: the masked float32 argmax exactly), a sampled one
reads the whole float head, masked; neither drafts. So neither the screen nor a draft ever picks a
token the grammar forbids.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import torch

# every JSON object (OpenAI's {"type": "json_object"})
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# JSON laid out one way (", " and ": ", no other whitespace): a small model given free whitespace can
# spend every token on it (measured: Gemma 3 270M filled 40 tokens with it, sampled at 0.3)
JSON_OPTIONS: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions


def grammar_for(response_format: dict[str, Any] | None) -> str | None:
    """The llguidance grammar of a request's response_format (None: plain text), or ValueError naming
    what is wrong with it."""
    import llguidance

    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = ANY_OBJECT
    elif kind == "json_schema":
        spec = response_format.get("json_schema") if response_format else None
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", ANY_OBJECT), dict):
            raise ValueError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        schema = spec.get("schema", ANY_OBJECT)
    else:
        raise ValueError(f"response_format type {kind!r} is not one of text, json_object, json_schema")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"response_format's schema is invalid: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"response_format's schema is invalid: {error}")
    return str(grammar)


@functools.cache
def _compiled_tokenizer(hf: Any) -> Any:
    """llguidance's view of a tokenizer (about 4 s for Gemma 3's: built once per tokenizer)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf)


class Grammar:
    """A grammar's state over one answer's tokens (`sampling.TokenConstraint`)."""

    def __init__(self, hf_tokenizer: Any, grammar: str) -> None:
        import llguidance
        import llguidance.torch

        self._tok = _compiled_tokenizer(hf_tokenizer)
        self._matcher = llguidance.LLMatcher(self._tok, grammar)
        self._bits = llguidance.torch.allocate_token_bitmask(1, self._tok.vocab_size)
        self._fill = llguidance.torch.fill_next_token_bitmask
        if self._matcher.is_error():
            raise ValueError(f"response_format's schema is invalid: {self._matcher.get_error()}")

    def allowed(self, vocab: int) -> torch.Tensor:
        self._fill(self._matcher, self._bits, 0)
        bits = (self._bits[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        flat = bits.reshape(-1).bool()
        out = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, flat.shape[0])
        out[:n] = flat[:n]
        return out

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise ValueError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    def finished(self) -> bool:
        return bool(self._matcher.is_stopped())

    def lookahead(self, tokens: Sequence[int], vocab: int) -> list[torch.Tensor]:
        """The masks a draft's rows need: consumed as far as the grammar accepts them, then rolled back."""
        masks = [self.allowed(vocab)]
        valid = self._matcher.validate_tokens(list(tokens))  # how many it accepts in a row (no change)
        taken = 0
        for t in tokens[:valid]:
            if not self._matcher.consume_token(t):
                break
            taken += 1
            if self._matcher.is_stopped():
                break
            masks.append(self.allowed(vocab))
        if taken:
            self._matcher.rollback(taken)
        return masks
