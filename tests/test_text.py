import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfuse.text import Prompt, complete_text, stream_text


class CharTokenizer:
    """One token per character (id = code point + 10); 2 is BOS."""

    bos_id = 2

    def encode(self, text: str) -> list[int]:
        return [ord(c) + 10 for c in text]

    def decode(self, ids) -> str:  # type: ignore[no-untyped-def]
        return "".join(chr(i - 10) for i in ids if i >= 10)


TOK = CharTokenizer()


def test_prompt_layout_is_deterministic_and_segmented() -> None:
    p = Prompt(head="H\n", prefix_text=" policy ", chunks=("alpha", "beta "), question=" why? ")
    req = p.request(TOK)  # type: ignore[arg-type]
    assert req.prefix[0] == 2 and TOK.decode(req.prefix) == "H\npolicy\n\n"
    assert [TOK.decode(c) for c in req.chunks] == ["alpha\n\n", "beta\n\n"]
    assert TOK.decode(req.suffix) == "Question: why?\nAnswer:"
    assert p.request(TOK) == req  # type: ignore[arg-type]
    flat = p.request(TOK, prefix_mode=True)  # type: ignore[arg-type]
    assert flat.chunks == () and flat.ids == req.ids


def test_stream_stops_at_stop_string_and_closes_the_source() -> None:
    closed = []

    def source():  # type: ignore[no-untyped-def]
        try:
            yield from TOK.encode("Paris\nQuestion: more")
        finally:
            closed.append(True)

    assert complete_text(source(), TOK, ["\n"]) == "Paris"  # type: ignore[arg-type]
    assert closed == [True]


@settings(max_examples=80, deadline=None)
@given(text=st.text(alphabet="ab\nQ:", max_size=30), stop=st.sampled_from(["\n", "Q:", "ab\n", "bb"]))
def test_streamed_text_equals_cut_text(text: str, stop: str) -> None:
    deltas = list(stream_text(TOK.encode(text), TOK, [stop]))  # type: ignore[arg-type]
    cut = text.find(stop)
    assert "".join(deltas) == (text if cut < 0 else text[:cut])
    assert all(deltas)


class HalfCharTokenizer:
    """Decodes a fixed text whose last character is still incomplete (as a byte-level tokenizer does)."""

    def decode(self, ids) -> str:  # type: ignore[no-untyped-def]
        return "yes\nand more\ufffd"


def test_a_stop_string_is_cut_even_when_the_tokens_end_mid_character() -> None:
    from kvfuse.text import TextDeltas

    deltas = TextDeltas(HalfCharTokenizer(), ["\n"])  # type: ignore[arg-type]
    assert deltas.push(1) == ""  # waits for the rest of the character
    assert deltas.flush() == "yes" and deltas.stopped
    assert deltas.push(2) == "" and deltas.flush() == ""


def test_an_answer_that_starts_with_a_newline_is_kept() -> None:
    from kvfuse.text import complete_answer

    ids = TOK.encode("\n\n 30 days.\nQuestion: next")
    assert complete_text(iter(ids), TOK) == ""  # a plain stop at the first newline cuts it to nothing
    done = complete_answer(iter(ids), TOK)
    assert done.text == "30 days." and done.stopped
    unended = complete_answer(iter(TOK.encode("\n30 days")), TOK)
    assert unended.text == "30 days" and not unended.stopped  # ran out of tokens: no stop string


def _tiny_tokenizer(root, config: dict) -> None:  # type: ignore[no-untyped-def]
    import json

    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {w: i for i, w in enumerate(["<unk>", "hi", "there", "<", "s", ">", "/", "turn", "!", "ok"])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.add_tokens([AddedToken("<turn>", special=False)])
    root.mkdir()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("config", [
    {"bos_token": "<s>", "eos_token": "</s>"},  # read by `tokenizers` alone
    {"bos_token": "<s>", "additional_special_tokens": ["<turn>"]},  # transformers marks <turn> special
    {"bos_token": "<s>", "clean_up_tokenization_spaces": True},  # transformers cleans decoded spaces
])
def test_tokenizer_reads_as_transformers_does(tmp_path, config: dict) -> None:  # type: ignore[no-untyped-def]
    """`Tokenizer` reads tokenizer.json itself where transformers would read it as it is, and leaves the
    rest to transformers; either way its ids, text and BOS are transformers' (the oracle)."""
    from transformers import PreTrainedTokenizerFast

    from kvfuse.text.tokenizer import Tokenizer

    _tiny_tokenizer(tmp_path / "tok", config)
    ours, oracle = Tokenizer(tmp_path / "tok"), PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    text = "<s> hi there ! <turn> ok </s> hi"
    assert ours.encode(text) == oracle.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert ours.encode_markup(text) == oracle.encode(text, add_special_tokens=False)
    ids = ours.encode_markup(text)
    assert ours.encode_markup(text) != ours.encode(text)
    assert ours.decode(ids) == oracle.decode(ids, skip_special_tokens=True)
    assert ours.encode_offsets(text)[1] == [tuple(s) for s in oracle(
        text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)["offset_mapping"]]
    assert ours.bos_id == oracle.bos_token_id == 10
    assert (ours._hf is None) == (config == {"bos_token": "<s>", "eos_token": "</s>"})
