"""The checkpoint's tokenizer: its tokenizer.json read by the `tokenizers` library (Hugging Face's Rust
tokenizer, the one transformers' fast tokenizers wrap), and its chat template if any.

Reading tokenizer.json straight with `tokenizers` gives transformers' ids, offsets and text (tested
against AutoTokenizer on both packaged models) in about a third of the time, without importing
transformers: the CLI pays that at every start. transformers is loaded only where it is needed, to
render a checkpoint's own Jinja chat template and for the grammar library (`hf`), and it reads a
checkpoint without a tokenizer.json, or one whose decoding cleans up spaces (transformers' own rule).
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    """The checkpoint's tokenizer (tokenizer.json), on token ids and text."""

    def __init__(self, path: str | Path) -> None:
        from kvfuse.heap import return_freed_memory

        self.path = Path(path)
        self._config = _config(self.path)
        self._hf: Any = None
        self._lock = threading.Lock()  # `encode_markup` turns the control tokens' matching on for a call
        self._hf_lock = threading.Lock()
        file = self.path / "tokenizer.json"
        self._rust: Any = None
        if file.is_file() and not self._config.get("clean_up_tokenization_spaces"):
            from tokenizers import Tokenizer as Rust

            rust = Rust.from_file(str(file))
            if _as_transformers_reads(rust, self._config):
                rust.encode_special_tokens = True  # a control token's spelling in text stays characters
                self._rust = rust
        if self._rust is not None:
            bos = _content(self._config.get("bos_token"))
            self.bos_id: int | None = self._rust.token_to_id(bos) if bos is not None else None
        else:
            self.bos_id = self.hf.bos_token_id
        # parsing the file leaves about 300 MB of freed heap behind
        return_freed_memory()

    def encode(self, text: str) -> list[int]:
        """Text as text: a control token's spelling in it (`<end_of_turn>`, `<|im_start|>`, `<eos>`) is
        encoded as its characters, never as the control token. Everything a request brings is text."""
        if self._rust is None:
            return list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=True))
        with self._lock:
            return list(self._one(text).ids)

    def encode_markup(self, markup: str) -> list[int]:
        """A template's own markup (turn markers, a stop marker): control tokens' spellings become them.
        Only the chat templates call this, on strings of their own."""
        if self._rust is None:
            return list(self.hf.encode(markup, add_special_tokens=False))
        with self._lock:
            self._rust.encode_special_tokens = False
            try:
                return list(self._one(markup).ids)
            finally:
                self._rust.encode_special_tokens = True

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids with the (start, end) character span of each in text (text as text, as `encode`)."""
        if self._rust is None:
            enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
            return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]
        with self._lock:
            got = self._one(text)
        return list(got.ids), [(int(a), int(b)) for a, b in got.offsets]

    def _one(self, text: str) -> Any:
        """One text's encoding. `encode_batch`, not `encode`: only the batch call lets go of the GIL while
        it works (as transformers calls it), so a 6 MB body tokenised on the planner thread does not stop
        the model thread's Python for seconds (test_a_maximal_body_stalls_neither_a_stream_nor_health)."""
        return self._rust.encode_batch([text], add_special_tokens=False)[0]

    def decode(self, ids: Sequence[int]) -> str:
        if self._rust is None:
            return str(self.hf.decode(list(ids), skip_special_tokens=True))
        return str(self._rust.decode(list(ids), skip_special_tokens=True))

    @functools.cached_property
    def fingerprint(self) -> str | None:
        """The vocabulary as a short key (`checkpoints.vocab_digest`), for what is kept on disk per
        vocabulary (`kb.conflicts.kb_index`); None without a tokenizer.json."""
        from kvfuse.checkpoints import vocab_digest

        return vocab_digest(self.path)

    def token_text(self, token_id: int) -> str:
        if self._rust is None:
            return str(self.hf.convert_ids_to_tokens(token_id))
        return str(self._rust.id_to_token(token_id))

    @property
    def hf(self) -> Any:
        """The Hugging Face fast tokenizer of the same files (what a grammar library compiles against,
        and what renders a Jinja chat template), loaded at first use."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import AutoTokenizer, PreTrainedTokenizerFast

                from kvfuse.heap import return_freed_memory

                # the generic fast class reads tokenizer.json as it is; a model's own class may first
                # rebuild the vocabulary in Python (transformers 5's GemmaTokenizer: 150 MB more RSS)
                whole = (self.path / "tokenizer.json").is_file()
                self._hf = (PreTrainedTokenizerFast if whole else AutoTokenizer).from_pretrained(str(self.path))
                return_freed_memory()
            return self._hf

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's own Jinja chat template, if it ships one."""
        if self._rust is not None:
            file = self.path / "chat_template.jinja"
            if file.is_file():
                return file.read_text(encoding="utf-8") or None
            t = self._config.get("chat_template")
            if t is None or isinstance(t, str):
                return t or None
        t = getattr(self.hf, "chat_template", None)
        return t if isinstance(t, str) and t else None

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The checkpoint's chat template rendered as text (by transformers)."""
        return str(self.hf.apply_chat_template(list(messages), tokenize=False,
                                               add_generation_prompt=add_generation_prompt))


def _config(path: Path) -> dict[str, Any]:
    """tokenizer_config.json over special_tokens_map.json (an older checkpoint names its tokens there)."""
    out: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = path / name
        try:
            got = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
        except (OSError, ValueError):
            continue
        out.update(got if isinstance(got, dict) else {})
    return out


def _as_transformers_reads(rust: Any, config: dict[str, Any]) -> bool:
    """Whether transformers would read tokenizer.json as it is: it adds every special token the config
    names that the file lacks, or marks it special, which changes what decoding skips."""
    special = {t.content for t in rust.get_added_tokens_decoder().values() if t.special}
    named = [config.get(k) for k in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                                     "cls_token", "mask_token")]
    for k in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(k)
        named += list(extra.values()) if isinstance(extra, dict) else list(extra or ())
    return all(t is None or _content(t) in special for t in named)


def _content(token: object) -> str | None:
    """A special token's spelling as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None
