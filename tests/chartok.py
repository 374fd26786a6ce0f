"""A character tokenizer over a tiny vocabulary, so text-level code can run on tiny random models."""

from __future__ import annotations

from collections.abc import Sequence


class CharTokenizer:
    bos_id = 1

    def __init__(self, vocab: int = 128) -> None:
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % (self.vocab - 3) for c in text]

    def encode_markup(self, markup: str) -> list[int]:  # no control tokens in a character vocabulary
        return self.encode(markup)

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        return self.encode(text), [(i, i + 1) for i in range(len(text))]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i - 3 + 32) if 35 <= i < 3 + 95 + 32 else "?" for i in ids)
