"""A thin wrapper over the checkpoint's HF tokenizer (tokenizer.json, and its chat template if any)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    """A thin wrapper over the checkpoint's HF tokenizer (tokenizer.json)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        from kvfuse.heap import return_freed_memory

        # A checkpoint with a tokenizer.json is read by the generic fast class, straight from that file.
        # A model's own class may first rebuild the vocabulary in Python: transformers 5's GemmaTokenizer
        # keeps Gemma 3's 262k tokens and merges as Python objects, 150 MB more RSS, for the same ids
        # (tested against AutoTokenizer). Parsing the file leaves about 300 MB of freed heap behind.
        whole = (Path(path) / "tokenizer.json").is_file()
        self._tok: Any = (PreTrainedTokenizerFast if whole else AutoTokenizer).from_pretrained(str(path))
        return_freed_memory()
        self.bos_id: int | None = self._tok.bos_token_id

    def encode(self, text: str) -> list[int]:
        """Text as text: a control token's spelling in it (`<end_of_turn>`, `<|im_start|>`, `<eos>`) is
        encoded as its characters, never as the control token. Everything a request brings is text."""
        return list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=True))

    def encode_markup(self, markup: str) -> list[int]:
        """A template's own markup (turn markers, a stop marker): control tokens' spellings become them.
        Only the chat templates call this, on strings of their own."""
        return list(self._tok.encode(markup, add_special_tokens=False))

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids with the (start, end) character span of each in text (text as text, as `encode`)."""
        enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
        return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    @property
    def hf(self) -> Any:
        """The Hugging Face fast tokenizer underneath (what a grammar library compiles against)."""
        return self._tok

    def token_text(self, token_id: int) -> str:
        return str(self._tok.convert_ids_to_tokens(token_id))

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's own Jinja chat template, if it ships one."""
        t = getattr(self._tok, "chat_template", None)
        return t if isinstance(t, str) and t else None

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The checkpoint's chat template rendered as text."""
        return str(self._tok.apply_chat_template(list(messages), tokenize=False,
                                                 add_generation_prompt=add_generation_prompt))
