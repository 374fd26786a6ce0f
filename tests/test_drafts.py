"""Drafts from the context: the proposer against a naive search, and greedy decoding with drafts
against plain greedy decoding (token for token) and against stepping one token at a time (bitwise)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import rand_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfuse.drafts import Context, DraftLength, cover, propose, space_mark, token_keys
from kvfuse.engine import Engine, Request
from kvfuse.engine.decode import Slot, step_hidden, step_rows
from kvfuse.engine.lmhead import BRIEF_SCREEN, GreedyHead, default_screen
from kvfuse.engine.sampling import SamplingParams


def naive_propose(ctx: list[int], k: int, max_ngram: int = 3, keys: list[int] | None = None) -> list[int]:
    match = ctx if keys is None else keys
    for n in range(min(max_ngram, len(ctx) - 1), 0, -1):
        key = match[len(ctx) - n :]
        for i in range(len(ctx) - n - 1, -1, -1):  # the latest earlier start first
            if match[i : i + n] == key:
                ext, out = list(ctx), []
                for j in range(i + n, i + n + k):  # what followed, copying on past the end (LZ77-style)
                    ext.append(ext[j])
                    out.append(ext[j])
                return out
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(0, 8))
def test_propose_equals_a_naive_search(ctx: list[int], k: int) -> None:
    want = naive_propose(ctx, k) if k > 0 else []
    assert propose(np.array(ctx, dtype=np.int64), k) == want


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 7), max_size=40), st.integers(0, 8), st.lists(st.integers(0, 7), min_size=8, max_size=8))
def test_propose_on_keys_equals_a_naive_search_on_them(ctx: list[int], k: int, table: list[int]) -> None:
    """n-grams matched on the tokens' keys (any many-to-one table); the draft copies the tokens."""
    keys = [table[t] for t in ctx]
    want = naive_propose(ctx, k, keys=keys) if k > 0 else []
    assert propose(np.array(ctx, dtype=np.int64), k, keys=np.array(keys, dtype=np.int64)) == want


def test_token_keys_join_a_spelling_with_and_without_its_leading_space() -> None:
    """The vocabulary's own space mark is stripped: "▁" in a SentencePiece one, where a piece that
    begins with a literal "Ġ" is a letter, and "Ġ" in a byte-level one, the other way round."""
    pieces = ["I", "\u2581I", "\u2581was", "Duplicate", None, "\u2581", "\u0120Duplicate", "\u2581\u2581", "was"]
    assert space_mark(pieces) == "\u2581"
    keys = token_keys(pieces)
    assert keys.tolist() == [0, 0, 2, 3, 4, 5, 6, 5, 2]
    assert cover(keys, 11).tolist() == keys.tolist() + [9, 10]  # ids past the pieces keep their own
    assert cover(keys, 5) is keys
    byte_level = ["I", "\u0120I", "\u0120was", "was", "\u2581I", "\u0120"]
    assert space_mark(byte_level) == "\u0120"
    assert token_keys(byte_level).tolist() == [0, 0, 2, 2, 4, 5]


def test_a_quote_that_starts_a_line_drafts_the_source_it_copies() -> None:
    """The source has " I was charged" after a space; the quote begins "I" (no space) after a mark."""
    pieces = ["<q>", "I", "\u2581I", "\u2581was", "\u2581charged", "\u2581twice", ".", "\u2581Quote"]
    table = token_keys(pieces)
    source, quote = [6, 2, 3, 4, 5, 6], [7, 0, 1]
    c = Context(source + quote, room=4, table=table)
    assert c.propose(4) == [3, 4, 5, 6]
    assert Context(source + quote, room=4).propose(4) == []  # matched as tokens: no " I" is "I"
    c.extend([3, 4])
    assert c.propose(2) == [5, 6] and c.keys is not None and c.keys[: c.n].tolist() == table[c.ids[: c.n]].tolist()


def test_propose_prefers_the_longest_suffix_and_the_latest_occurrence() -> None:
    ctx = [5, 1, 2, 9, 9, 7, 2, 8, 8, 1, 2]
    assert propose(np.array(ctx), 2) == [9, 9]  # (1, 2) occurred at 1: what followed it
    assert propose(np.array([3, 2, 7, 2, 6, 6, 2]), 3) == [6, 6, 2]  # (6, 2) at 5? no: (2,) latest at 3
    assert propose(np.array([1, 2, 3]), 4) == []


def test_a_repeating_pattern_is_drafted_past_the_end_of_its_last_period() -> None:
    assert propose(np.array([5, 1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]  # (1, 2) at 1: then 1, 2, and on
    assert propose(np.array([4, 7, 7, 7]), 3) == [7, 7, 7]  # (7, 7) latest at 2: a period of one
    assert propose(np.array([8, 1, 2, 3, 8, 1]), 6) == [2, 3, 8, 1, 2, 3]


@pytest.mark.parametrize("table", [None, np.array([0, 1, 1, 3])])
def test_context_grows_past_its_room(table: np.ndarray | None) -> None:
    c = Context([1, 2, 3], room=1, table=table)
    for t in (1, 2, 3, 1):
        c.extend([t])
    assert c.ids[: c.n].tolist() == [1, 2, 3, 1, 2, 3, 1]
    assert c.propose(3) == [2, 3, 1]
    if table is not None:
        assert c.keys is not None and c.keys[: c.n].tolist() == [1, 1, 3, 1, 1, 3, 1]


def test_draft_length_grows_on_success_and_shrinks_on_rejection() -> None:
    d = DraftLength(most=6, now=3)
    d.update(3, 3)
    assert d.now == 5
    d.update(5, 5)
    assert d.now == 6
    d.update(6, 2)
    d.update(5, 0)
    assert d.now == 4
    d.update(0, 0)  # no draft: unchanged
    assert d.now == 4
    for _ in range(9):
        d.update(1, 0)
    assert d.now == 1


def test_draft_length_grows_past_the_usual_length_only_in_a_run_of_drafts_taken_whole() -> None:
    d = DraftLength(most=15, now=6, usual=6)
    d.update(6, 6)  # one draft taken whole: still within the usual length
    assert d.now == 6
    d.update(6, 6)  # two in a row: the request is copying, its drafts may grow
    assert d.now == 8
    d.update(8, 8)
    d.update(10, 10)
    d.update(12, 12)
    assert d.now == 14
    d.update(14, 14)
    assert d.now == 15  # never past `most`
    d.update(15, 3)  # a rejection ends the run: back within the usual length
    assert (d.now, d.run) == (5, 0)
    d.update(5, 5)  # one taken whole after it is not a run yet
    assert d.now == 6
    d.update(6, 6)
    assert d.now == 8
    short = DraftLength(most=4, now=4, usual=6)  # `most` bounds the usual length too
    for _ in range(3):
        short.update(4, 4)
    assert short.now == 4


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_rows_of_one_slot_equal_stepping_one_token_at_a_time(tiny_engines, family: str) -> None:
    e: Engine = tiny_engines[family]
    if e.decode_batch_limit() < 2:
        pytest.skip("this machine keeps no two rows bitwise equal")
    with torch.inference_mode():
        fused = e.prefill(Request(prefix=(1,) + rand_ids(9, 3), chunks=(), suffix=rand_ids(4, 4)), room=8).fused
        toks = list(rand_ids(3, 7))
        one = Slot(e.model, fused.cache, 8)
        seq = torch.cat([step_hidden(e.model, [one], [t]) for t in toks])
        two = Slot(e.model, fused.cache, 8)
        # two rows a step (the tiny widths keep two bitwise), a rejected row rewound and fed again
        rows = torch.cat([step_rows(e.model, [two], [toks[:2]])])
        two.rewind(1)
        again = step_rows(e.model, [two], [toks[1:]])
    assert torch.equal(rows, seq[:2]) and torch.equal(again, seq[1:]), (rows - seq[:2]).abs().max()
    assert two.n == one.n and torch.equal(two.k[:, :, : two.n], one.k[:, :, : one.n])


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "w8a8"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_with_drafts_equals_plain_greedy(engine_at, family: str, precision: str, monkeypatch) -> None:
    e: Engine = engine_at(family, precision)
    reqs = [Request(prefix=(1,) + rand_ids(5, s) * 3, chunks=(rand_ids(7, s + 1),), suffix=rand_ids(4, s))
            for s in range(4)]
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    for r in reqs:
        e.precompute(r, "blend")
    monkeypatch.setattr(e, "draft_tokens", 0)
    plain = [e.generate(r, "blend", 0.5, greedy) for r in reqs]
    assert all(g.drafts.drafted == 0 for g in plain)
    monkeypatch.setattr(e, "draft_tokens", 6)
    drafted = [e.generate(r, "blend", 0.5, greedy) for r in reqs]
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    # keys that join many tokens (every third id alike) propose many wrong drafts: the answers stay
    monkeypatch.setattr(e.scheduler, "draft_keys", np.arange(e.cfg.vocab_size) % 3)
    keyed = [e.generate(r, "blend", 0.5, greedy) for r in reqs]
    assert [g.tokens for g in keyed] == [g.tokens for g in plain]
    if e.scheduler.drafts_pay():
        assert sum(g.drafts.drafted for g in keyed) > sum(g.drafts.drafted for g in drafted)
    # drafts only where the layers are float on the CPU (fp32, bf16): int8's extra rows are dear
    assert e.scheduler.drafts_pay() == (precision in ("fp32", "bf16"))
    if e.decode_batch_limit() >= 2 and e.scheduler.drafts_pay():
        assert sum(g.drafts.accepted for g in drafted) > 0  # drafts were taken, not only proposed
    if not e.scheduler.drafts_pay():
        assert all(g.drafts.drafted == 0 for g in drafted)
    # recorded logits never draft
    rec = e.generate(reqs[0], "blend", 0.5, greedy, record_logits=True)
    assert rec.tokens == plain[0].tokens and rec.drafts.drafted == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_step_works_out_greedy_rows_only_up_to_the_first_rejected_draft_token(engine_at, precision: str,
                                                                              monkeypatch) -> None:
    """The rows after a draft's first wrong token are stepped but never read: their bounds and exact
    candidates are not computed (each row read gives one token), and the answer is plain greedy's."""
    e: Engine = engine_at("gemma3", precision)
    r = Request(prefix=(1,) + rand_ids(5, 3) * 3, chunks=(rand_ids(7, 4),), suffix=rand_ids(4, 3))
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    e.precompute(r, "blend")
    monkeypatch.setattr(e, "draft_tokens", 0)
    plain = e.generate(r, "blend", 0.5, greedy)
    monkeypatch.setattr(e, "draft_tokens", 6)
    monkeypatch.setattr(e.scheduler, "draft_keys", np.arange(e.cfg.vocab_size) % 3)  # many wrong drafts
    read: list[int] = []
    real = GreedyHead.argmax_rows

    def counted(head: GreedyHead, xs: torch.Tensor, *args, **kwargs) -> list[int]:  # type: ignore[no-untyped-def]
        read.append(xs.shape[0])
        return real(head, xs, *args, **kwargs)

    monkeypatch.setattr(GreedyHead, "argmax_rows", counted)
    g = e.generate(r, "blend", 0.5, greedy)
    assert g.tokens == plain.tokens
    assert g.drafts.drafted > g.drafts.accepted  # some drafted rows were rejected
    assert set(read) == {1} and sum(read) == len(g.tokens)  # one row read per token taken, the first one's too


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_seeded_sampling_with_drafts_gets_the_tokens_it_gets_without(engine_at, family: str, precision: str,
                                                                     monkeypatch) -> None:
    """The rejection rule for a draft from the context (accept x with probability p(x), else draw from p
    without x) drawn as one draw from p per token taken: a seeded sampled request, with penalties and a
    bias too, gets exactly the tokens it gets without drafts, and drafts are accepted."""
    e: Engine = engine_at(family, precision)
    reqs = [Request(prefix=(1,) + rand_ids(5, s) * 3, chunks=(), suffix=rand_ids(4, s)) for s in range(3)]
    params = [SamplingParams(max_tokens=16, temperature=0.05, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.05, seed=5, ignore_eos=True, frequency_penalty=0.5,
                             logit_bias=((7, 2.0),)),
              SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=0.4)]  # greedy, adjusted
    monkeypatch.setattr(e, "draft_tokens", 0)
    plain = [[e.generate(r, "prefix", params=p).tokens for p in params] for r in reqs]
    monkeypatch.setattr(e, "draft_tokens", 6)
    drafted = [[e.generate(r, "prefix", params=p) for p in params] for r in reqs]
    assert [[g.tokens for g in row] for row in drafted] == plain
    if e.decode_batch_limit() >= 2:
        assert sum(g.drafts.accepted for row in drafted for g in row) > 0


class _Forbid:
    """A toy grammar over ids: step i forbids `banned[i]` (everything else allowed); finished after the
    last step. Its `lookahead` walks a draft as `sampling.TokenConstraint` says."""

    def __init__(self, banned: list[set[int]]) -> None:
        self.banned, self.at = banned, 0

    def _mask(self, at: int, vocab: int) -> torch.Tensor:
        out = torch.ones(vocab, dtype=torch.bool)
        out[list(self.banned[at])] = False
        return out

    def allowed(self, vocab: int) -> torch.Tensor:
        return self._mask(self.at, vocab)

    def advance(self, token: int) -> None:
        assert token not in self.banned[self.at], (self.at, token)
        self.at += 1

    def finished(self) -> bool:
        return self.at == len(self.banned)

    def lookahead(self, tokens: list[int], vocab: int) -> list[torch.Tensor]:
        masks, at = [self._mask(self.at, vocab)], self.at
        for t in tokens:
            if t in self.banned[at] or at + 1 == len(self.banned):
                break
            at += 1
            masks.append(self._mask(at, vocab))
        return masks


@pytest.mark.parametrize("temperature", [0.0, 0.05])
def test_a_grammar_request_drafts_and_gets_the_tokens_it_gets_without(engine_at, temperature: float,
                                                                      monkeypatch) -> None:
    """Drafts under a grammar: each row is masked with the grammar's state after the draft tokens before
    it, so a greedy (screened) or seeded sampled request gets exactly its undrafted tokens, drafts are
    accepted, and a draft token the grammar forbids is never taken."""
    e: Engine = engine_at("llama", "fp32")
    reqs = [Request(prefix=(1,) + rand_ids(5, s) * 3, chunks=(), suffix=rand_ids(4, s)) for s in range(3)]
    params = SamplingParams(max_tokens=16, temperature=temperature, seed=4, ignore_eos=True)
    monkeypatch.setattr(e, "draft_tokens", 0)
    free = [e.generate(r, "prefix", params=params).tokens for r in reqs]
    # forbid, at some steps, the token the model took there unconstrained: the grammar changes answers
    banned = [[{toks[i]} if i % 3 == 1 else set() for i in range(16)] for toks in free]
    plain = [e.generate(r, "prefix", params=params, constraint=_Forbid(b)) for r, b in zip(reqs, banned, strict=True)]
    assert all(g.drafts.drafted == 0 for g in plain) and [g.tokens for g in plain] != free
    monkeypatch.setattr(e, "draft_tokens", 6)
    drafted = [e.generate(r, "prefix", params=params, constraint=_Forbid(b))
               for r, b in zip(reqs, banned, strict=True)]
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert all(t not in b[i] for g, b in zip(drafted, banned, strict=True) for i, t in enumerate(g.tokens))
    if e.decode_batch_limit() >= 2:
        assert sum(g.drafts.accepted for g in drafted) > 0


def test_vocab_pieces_reads_a_checkpoints_tokenizer_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from kvfuse.checkpoints import vocab_pieces

    assert vocab_pieces(tmp_path) is None  # no tokenizer.json: drafts match tokens as they are
    Tokenizer(WordLevel({"I": 0, "\u2581I": 1, "\u2581was": 3}, unk_token="I")).save(str(tmp_path / "tokenizer.json"))
    pieces = vocab_pieces(tmp_path)
    assert pieces == ["I", "\u2581I", None, "\u2581was"]  # id 2 is spelled by nothing
    assert token_keys(pieces).tolist() == [0, 0, 2, 3]
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert vocab_pieces(tmp_path) is None  # unreadable: the same, with a warning


def test_vocab_keys_are_kept_beside_tokenizer_json_and_made_again_when_it_changes(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The keys are `token_keys(vocab_pieces(...))`: made once, then read from the kept file while the
    tokenizer.json and the keying rule are those they were made from; a changed vocabulary, another
    rule or an unreadable file makes them again, and a directory that cannot be written still gets them."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    import kvfuse.checkpoints as ck
    import kvfuse.drafts as drafts

    def save(vocab: dict[str, int]) -> None:
        Tokenizer(WordLevel(vocab, unk_token="I")).save(str(tmp_path / "tokenizer.json"))

    assert ck.vocab_keys(tmp_path) is None  # no tokenizer.json
    save({"I": 0, "\u2581I": 1, "\u2581was": 3})
    real_pieces, reads = ck.vocab_pieces, []
    monkeypatch.setattr(ck, "vocab_pieces", lambda root: reads.append(root) or real_pieces(root))
    first = ck.vocab_keys(tmp_path)
    assert first is not None and first.tolist() == token_keys(real_pieces(tmp_path)).tolist() == [0, 0, 2, 3]
    assert (tmp_path / ck.KEYS_FILE).is_file() and len(reads) == 1
    again = ck.vocab_keys(tmp_path)
    assert again is not None and again.tolist() == first.tolist() and len(reads) == 1  # read from the kept file
    save({"was": 0, "\u2581was": 1, "I": 2, "\u2581I": 3})  # another vocabulary: not the kept keys
    assert ck.vocab_keys(tmp_path).tolist() == [0, 0, 2, 2] and len(reads) == 2  # type: ignore[union-attr]
    monkeypatch.setattr(drafts, "KEYS_RULE", drafts.KEYS_RULE + 1)  # another rule: made again
    assert ck.vocab_keys(tmp_path).tolist() == [0, 0, 2, 2] and len(reads) == 3  # type: ignore[union-attr]
    assert ck.vocab_keys(tmp_path).tolist() == [0, 0, 2, 2] and len(reads) == 3  # type: ignore[union-attr]
    (tmp_path / ck.KEYS_FILE).write_bytes(b"not a zip")  # unreadable: made again, and kept again
    assert ck.vocab_keys(tmp_path).tolist() == [0, 0, 2, 2] and len(reads) == 4  # type: ignore[union-attr]
    assert ck.vocab_keys(tmp_path).tolist() == [0, 0, 2, 2] and len(reads) == 4  # type: ignore[union-attr]

    def refuse(*args: object) -> None:
        raise OSError("read-only")

    (tmp_path / ck.KEYS_FILE).unlink()
    monkeypatch.setattr(ck.os, "replace", refuse)  # the directory cannot be written: keys all the same
    assert ck.vocab_keys(tmp_path).tolist() == [0, 0, 2, 2]  # type: ignore[union-attr]
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # nothing kept, nothing left behind


def test_engine_load_keys_drafts_by_the_checkpoints_vocabulary(tiny_models, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Engine.load reads tokenizer.json's spellings into the scheduler's keys, over the whole vocabulary;
    a table too short for the model's ids is refused. An engine that will not decode reads neither the
    keys nor builds the greedy screen, which its first use would build."""
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    root = tmp_path / "ckpt"
    shutil.copytree(tiny_models["llama"][0], root)
    vocab = {"I": 5, "\u2581I": 9, "\u0120I": 11, "was": 12, "\u0120was": 13}  # byte-level: "Ġ" is its space
    Tokenizer(WordLevel(vocab, unk_token="I")).save(str(root / "tokenizer.json"))
    e = Engine.load(root, self_check=False)
    keys = e.scheduler.draft_keys
    assert keys is not None and len(keys) == e.cfg.vocab_size
    assert keys[11] == 5 and keys[13] == keys[12] == 12 and keys[7] == 7 and keys[9] == 9
    assert e.greedy_head() is e.scheduler.greedy_head()  # built at load, once
    with pytest.raises(ValueError, match="each of the model's"):
        e.scheduler.draft_keys = keys[:10]
    assert Engine.load(root, precision="int8", self_check=False).scheduler.draft_keys is None  # int8 drafts nothing
    built: list[str | None] = []
    real_build = GreedyHead.build
    monkeypatch.setattr(GreedyHead, "build", lambda w, kernel=None: built.append(kernel) or real_build(w, kernel))
    quiet = Engine.load(root, self_check=False, decodes="none")  # building caches only: no keys, no screen
    assert quiet.scheduler.draft_keys is None and not built
    assert quiet.greedy_head() is not None and len(built) == 1  # should it decode, the screen comes then
    # a command that answers once builds the screen that needs no packing; a server, the fastest a step
    assert e.greedy_head().kernel == default_screen() and quiet.greedy_head().kernel == default_screen()
    brief = Engine.load(root, self_check=False, decodes="few")
    assert brief.greedy_head().kernel == BRIEF_SCREEN and built[-1] == BRIEF_SCREEN
    assert brief.scheduler.draft_keys is not None
    with pytest.raises(ValueError, match="decodes must be one of none, few, many"):
        Engine.load(root, self_check=False, decodes="always")
