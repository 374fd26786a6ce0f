import threading

import pytest
from chartok import CharTokenizer
from kbdata import DOCS, write_kb

from kvfuse import fuse
from kvfuse.engine import Engine, Request
from kvfuse.engine.sampling import SamplingParams
from kvfuse.kb import answer
from kvfuse.kb.base import KnowledgeBase
from kvfuse.kb.cost import CostModel
from kvfuse.kb.manifest import Document, KBError, load_manifest
from kvfuse.kb.prefix import plan_prefix
from kvfuse.kb.quotes import find_quote, usable
from kvfuse.request import Salt
from kvfuse.store import open_store
from kvfuse.weights import load_model


@pytest.fixture
def kb(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    root, _ = tiny_models["gemma3"]
    lm = load_model(root)
    store_dir = tmp_path / "store"
    engine = Engine(lm.model, lm.fingerprint, store=open_store(store_dir, lm.fingerprint))
    write_kb(tmp_path / "kb")
    return KnowledgeBase.open(tmp_path / "kb", engine, CharTokenizer(), state_dir=store_dir)


def test_serialization_is_deterministic_and_ordered(tmp_path) -> None:
    tok = CharTokenizer()
    write_kb(tmp_path / "a")
    write_kb(tmp_path / "b", order=[3, 1, 0, 2])  # the manifest's order does not matter
    a = plan_prefix(load_manifest(tmp_path / "a"), tok, "leads")
    b = plan_prefix(load_manifest(tmp_path / "b"), tok, "leads")
    assert a.ids == b.ids and a.version == b.version
    assert [s.name for s in a.segments] == ["instructions", "plans", "billing", "margins", "faq"]  # (stability, id)
    assert plan_prefix(load_manifest(tmp_path / "a"), tok, "leads").ids == a.ids


def test_real_tokenizer_serialization_of_the_bundled_kb() -> None:
    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.text import Tokenizer

    tok = Tokenizer(resolve_model_path(None))
    m = load_manifest("albaran")
    one, two = plan_prefix(m, tok, "support"), plan_prefix(load_manifest("albaran"), tok, "support")
    assert one.ids == two.ids
    order = [(m.document(s.name).stability, s.name) for s in one.segments[1:]]
    assert order == sorted(order) and order[-1][0] == 5  # the FAQ goes last
    assert "discount-margins" not in {s.name for s in one.segments}
    assert "Commercial discount margins" not in tok.decode(one.ids)
    assert 8000 < len(one.ids) < 12000


def test_edit_recomputes_from_the_changed_block(kb, tmp_path) -> None:
    first = kb.build("support")
    assert first.tokens_reused == 0 and first.tokens_recomputed == first.tokens_total  # the tail too
    again = kb.build("support")
    assert again.loaded and again.tokens_recomputed == 0
    plan = kb.plan("support")
    faq = next(s for s in plan.segments if s.name == "faq")
    kb.put_document(Document("faq", "Faq", "docs/faq.md", 5, ("support", "leads"), False,
                             "Generally, refunds within 14 days."))
    last = kb.build("support")
    n_full = last.tokens_total // 16 * 16
    assert last.tokens_reused >= faq.start // 16 * 16  # everything before the changed block is reused
    assert 0 < last.tokens_recomputed <= faq.end - faq.start + 16
    plans = next(s for s in kb.plan("support").segments if s.name == "plans")
    kb.put_document(Document("plans", "Plans", "docs/plans.md", 1, ("support", "leads"), True,
                             "Team plan: 31 days to return an annual charge."))
    edit_first = kb.build("support")
    assert plans.start // 16 * 16 <= edit_first.tokens_reused < plans.end
    assert edit_first.tokens_recomputed == edit_first.tokens_total - edit_first.tokens_reused
    assert edit_first.tokens_recomputed > 3 * last.tokens_recomputed
    assert n_full > 0


def test_ask_answers_from_the_cache_and_recomputes_nothing_between_questions(kb) -> None:
    kb.build("support")
    entries = len(kb.engine.store.tiers[0])
    a1 = kb.ask("How many days?", "support", quote=False, max_tokens=4)
    a2 = kb.ask("Which day are invoices issued?", "support", quote=False, max_tokens=4)
    plan = kb.plan("support")
    for a, q in ((a1, "How many days?"), (a2, "Which day are invoices issued?")):
        suffix = len(CharTokenizer().encode(f"Question: {q}\nAnswer:"))
        assert len(plan.ids) % 16  # a partial last block: the build stored its tail entry (`CacheManager.tail_key`)
        assert a.tokens["cached"] == len(plan.ids)
        assert a.tokens["computed"] == suffix  # the question alone
        assert a.tokens["prompt"] == len(plan.ids) + suffix
        assert a.cost_units["write"] == 0 and a.cost_units["read"] == pytest.approx(a.tokens["cached"] * 0.1)
        assert a.cached_token_share == pytest.approx(a.tokens["cached"] / a.tokens["prompt"], abs=1e-4)
    assert len(kb.engine.store.tiers[0]) == entries  # the stored prefix was not extended
    assert 0 < a2.cumulative_cached_token_share < 1
    usage = kb.usage()["support"]
    assert usage["requests"] == 2 and usage["cached_tokens"] == a1.tokens["cached"] + a2.tokens["cached"]


def test_answer_equals_full_prefill_of_the_same_prompt(kb) -> None:
    kb.build("support")
    prep = answer.prepare(kb, "How many days?", "support")
    full = kb.engine.generate(Request(suffix=prep.request.suffix, prefix=prep.request.prefix), "full",
                              params=SamplingParams(max_tokens=5, ignore_eos=True))
    cag = kb.engine.generate(prep.request, prep.mode, params=SamplingParams(max_tokens=5, ignore_eos=True))
    assert cag.tokens == full.tokens and (cag.first_logits - full.first_logits).abs().max() < 1e-4


def test_hybrid_equals_full_at_ratio_one(kb) -> None:
    from kvfuse.rag.index import IndexChunk

    kb.build("support")
    chunks = [IndexChunk("t1", "Ticket 1", (), 0, 30, "Customer charged 20 days ago."),
              IndexChunk("t2", "Ticket 2", (), 0, 25, "Customer on the Team plan.")]
    prep = answer.prepare(kb, "Refund?", "support", passages=chunks, ratio=1.0)
    written, _ = answer.warm(kb, prep)
    assert prep.mode == fuse.DEFAULT_MODE and written == sum(len(c) for c in prep.request.chunks)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    hybrid = kb.engine.generate(prep.request, prep.mode, 1.0, params)
    full = kb.engine.generate(Request(suffix=prep.request.suffix, prefix=tuple(prep.request.ids[:-len(
        prep.request.suffix)])), "full", params=params)
    assert hybrid.counts.reused == len(prep.request.ids) - len(prep.request.suffix) - len(prep.plan.ids) % 16
    assert (hybrid.first_logits - full.first_logits).abs().max() < 1e-4 and hybrid.tokens == full.tokens
    cheap = kb.ask("Refund?", "support", chunks=chunks, ratio=0.2, quote=False, max_tokens=3)
    assert cheap.mode == fuse.DEFAULT_MODE and cheap.retrieved == ["t1", "t2"] and cheap.cost_units["write"] == 0
    assert cheap.fuser == fuse.spec_of(kb.engine.fuser(fuse.DEFAULT_MODE))  # its options settled for the model
    assert cheap.fuser.startswith("queryaware:weigh=")


def test_groups_get_their_own_prefix_and_never_share_entries(kb) -> None:
    support, leads = kb.plan("support"), kb.plan("leads")
    secret = CharTokenizer().encode("Secret margin")
    ids = list(support.ids)
    assert not any(ids[i : i + len(secret)] == secret for i in range(len(ids)))
    assert "margins" not in {s.name for s in support.segments} and "margins" in {s.name for s in leads.segments}
    h_support = set(kb.engine.cache.block_hashes(support.ids, support.salts))
    h_leads = set(kb.engine.cache.block_hashes(leads.ids, leads.salts))
    assert not h_support & h_leads  # even the identical first blocks are keyed apart
    kb.build("leads")
    assert kb.cached_tokens(support) == 0  # nothing of leads' cache is a hit for support
    before = kb.engine.store.stats.snapshot()
    kb.ask("Margin?", "support", quote=False, max_tokens=2)  # support's own blocks, built on demand
    assert kb.cached_tokens(support) == len(support.ids)
    kb.ask("Margin?", "support", quote=False, max_tokens=2)
    # support's own entries only: the build read its blocks once to compute the tail after them, and each
    # question read the blocks and the tail
    assert kb.engine.store.stats.since(before).hits == len(h_support) + 2 * (len(h_support) + 1)
    with pytest.raises(KBError, match="unknown group"):
        kb.plan("admins")


def test_tenant_salts_keep_private_segments_private(kb) -> None:
    a, b = kb.plan("support", "tenant-a"), kb.plan("support", "tenant-b")
    first_private = next(s for s in a.segments if not s.shared)
    kb.build("support", "tenant-a")
    shared_blocks = first_private.start // 16
    assert kb.cached_tokens(b) == shared_blocks * 16  # the shared plan terms still hit, the rest never does
    assert kb.cached_tokens(a) == len(a.ids)  # its blocks and its tail
    ha, hb = kb.engine.cache.block_hashes(a.ids, a.salts), kb.engine.cache.block_hashes(b.ids, b.salts)
    assert ha[:shared_blocks] == hb[:shared_blocks] and not set(ha[shared_blocks:]) & set(hb[shared_blocks:])
    chunk = tuple(CharTokenizer().encode("a tenant's own ticket"))
    key = kb.engine.cache.chunk_key
    assert key(chunk, Salt(tenant="a")) != key(chunk, Salt(tenant="b")) != key(chunk)
    assert Salt(tenant="a").key == "tenant:a" and Salt(kb="demo", group="support").key == "kb:demo/group:support"
    # what a request brings is its tenant's and group's own, or the tenant's where it opted in
    assert answer.prepare(kb, "q?", "support", "tenant-a").request.chunk_salt == Salt("demo", "support", "tenant-a")
    assert answer.prepare(kb, "q?", "support", "tenant-a", tenant_wide=True).request.chunk_salt == Salt(
        tenant="tenant-a")
    assert answer.prepare(kb, "q?", "support").request.chunk_salt is None


def test_cost_arithmetic_matches_the_seed() -> None:
    c = CostModel()
    day = c.daily(32_000, 600, writes=10)
    assert day["cag"]["total"] == pytest.approx(2_288_000) and day["no_cache"]["total"] == 19_200_000
    assert day["rag"]["total"] == 1_200_000
    assert c.request(written=100, cached=1000, computed=20) == {"write": 125.0, "read": 100.0, "uncached": 20.0,
                                                                "total": 245.0}
    assert CostModel(read=0.05).daily(32_000, 600, writes=10)["cag"]["read"] == pytest.approx(944_000)
    with pytest.raises(ValueError):
        CostModel(write=-1)


def test_quote_verification() -> None:
    docs = [Document("team", "Team", "", 1, ("s",), text="7. Returns\nAnnual subscriptions have 30 calendar\n"
                                                          "days from the date of the charge.")]
    c = find_quote('"annual SUBSCRIPTIONS have 30   calendar days from the date of the charge."', docs)
    assert c.verified and c.doc_id == "team" and docs[0].text[c.start : c.end].startswith("Annual subscriptions")
    assert docs[0].text[c.start : c.end].endswith("charge.")
    miss = find_quote("Annual subscriptions have 14 calendar days", docs)
    assert not miss.verified and miss.doc_id is None and miss.start is None
    assert not usable("30 days") and usable("have 30 calendar days")


def test_document_edits_are_checked_before_anything_is_written(kb) -> None:
    from kvfuse.kb.manifest import with_document

    for bad in (Document("ok", "T", "", 1, ("../x",), text="t"), Document("ok", "a\x00", "", 1, ("s",), text="t"),
                Document("bad id", "T", "", 1, ("s",), text="t"),
                Document("ok", "T", "../../x.md", 1, ("s",), text="t")):
        with pytest.raises(KBError):
            with_document(kb.manifest, bad)
    before = (kb.manifest.root / "kb.toml").read_text()
    with pytest.raises(KBError, match="window"):
        kb.put_document(Document("huge", "Huge", "", 3, ("support",), text="x" * 600))
    assert (kb.manifest.root / "kb.toml").read_text() == before and not (kb.manifest.root / "docs/huge.md").exists()


def test_manifest_errors(tmp_path) -> None:
    with pytest.raises(KBError, match="no kb.toml"):
        load_manifest(tmp_path)
    write_kb(tmp_path)
    (tmp_path / "docs" / "faq.md").unlink()
    with pytest.raises(KBError, match="cannot read"):
        load_manifest(tmp_path)
    write_kb(tmp_path, DOCS + [DOCS[0]])
    with pytest.raises(KBError, match="used twice"):
        load_manifest(tmp_path)
    (tmp_path / "kb.toml").write_text("name = [")
    with pytest.raises(KBError, match="not valid TOML"):
        load_manifest(tmp_path)


def test_concurrent_usage_updates_lose_nothing(kb) -> None:
    plan = kb.plan("support")
    def add() -> None:
        for _ in range(20):
            kb.usage_log.add(plan.group, 10, 9, 1.5)

    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    used = kb.usage()["support"]
    assert {k: used[k] for k in ("requests", "prompt_tokens", "cached_tokens", "cost_units")} == {
        "requests": 80, "prompt_tokens": 800, "cached_tokens": 720, "cost_units": 120.0}
    assert len(used["history"]) == 80 and all(share == 0.9 for _, share in used["history"])


def test_over_long_prefix_is_refused(kb, tmp_path) -> None:
    (kb.manifest.root / "docs" / "faq.md").write_text("x" * 600)  # edited on disk, behind kvfuse's back
    kb.reload()
    with pytest.raises(KBError, match="window is 512"):
        kb.build("support")
    # refused before any compute: nothing was written, and the knowledge base builds once it fits again
    assert sum(len(t) for t in kb.engine.store.tiers) == 0  # type: ignore[arg-type]
    (kb.manifest.root / "docs" / "faq.md").write_text("As a rule, refunds within 14 days.\n")
    kb.reload()
    assert kb.build("support").tokens_total > 0 and sum(len(t) for t in kb.engine.store.tiers) > 0  # type: ignore[arg-type]


def test_quote_offsets_survive_unicode_and_sentence_starts() -> None:
    from kvfuse.kb.quotes import sentence_around

    doc = Document("d", "D", "", 1, ("s",), text="İstanbul office: annual plans have 30 days. Next sentence here.")
    c = find_quote("annual plans have 30 days", [doc])
    assert c.verified and doc.text[c.start : c.end] == "annual plans have 30 days"
    first = sentence_around(doc, 0, 5)
    assert first.quote == "İstanbul office: annual plans have 30 days." and first.start == 0
    assert first.source == "retrieval"


def test_chat_template_keeps_conversations_prefix_stable() -> None:
    from kvfuse.text import ChatTemplate

    tok = CharTokenizer()
    t = ChatTemplate.for_model("gemma3_text", tok)  # chosen by the model's family, not by its vocabulary
    one = [("system", "Be brief."), ("user", "Hi")]
    two = one + [("assistant", "Hello!"), ("user", "More?")]
    first = t.turns(tok, one) + t.generation_prompt(tok)
    assert (t.turns(tok, two) + t.generation_prompt(tok))[: len(first)] == first
    def has(seq: list[int], text: str) -> bool:
        sub = tok.encode(text)
        return any(seq[i : i + len(sub)] == sub for i in range(len(seq)))

    assert not has(first, "system") and has(first, "user\nBe brief.\n\nHi")  # folded into the user turn
    plain = ChatTemplate.for_model("llama", CharTokenizer())  # no template of its own
    assert plain.stop_strings == ("\nUser:",) and has(plain.turns(tok, one), "System: Be brief.\n")
    assert has(plain.turns(tok, [("developer", "Be kind.")]), "Developer: Be kind.\n")  # as before


def test_a_question_on_a_built_prefix_hashes_its_blocks_at_most_once(kb, monkeypatch) -> None:
    """The prefix's chained block hashes are computed once: the build, the lookup, the store of the
    answer's blocks and the quote request all share them (vLLM hashes a request's blocks once)."""
    import kvfuse.store.keys as keys

    calls = []
    real = keys.hash_block_tokens

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(keys, "hash_block_tokens", counting)
    plan = kb.plan("support")
    blocks = len(plan.ids) // 16 + 1  # and the partial last block's tail
    kb.build("support")
    assert len(calls) == blocks  # the build hashed them, once
    calls.clear()
    kb.ask("How long is the refund window?", "support", max_tokens=3, quote=True)
    assert len(calls) == 0  # the answer and its quote request reuse the build's hashes
    kb.engine.cache = type(kb.engine.cache)(kb.engine.model, kb.engine.fingerprint, kb.engine.store,
                                            kb.engine.preamble, 16, kb.engine.kv_dtype)  # a fresh process
    kb.ask("How long is the refund window?", "support", max_tokens=3, quote=True)
    assert len(calls) == blocks


def test_a_looping_or_unclosed_quote_is_no_usable_quote() -> None:
    from kvfuse.kb.quotes import looping

    docs = [Document("team", "Team", "", 1, ("s",), text="Annual subscriptions have 30 calendar days to ask.")]
    good = answer.quote_citation(answer.QuoteAttempt("Annual subscriptions have 30 calendar days", True), docs)
    assert good.state == "verified" and good.verified and good.doc_id == "team"
    loop = "30 calendar days to ask 30 calendar days to ask 30 calendar days"
    assert looping(loop) and not looping("Annual subscriptions have 30 calendar days to ask.")
    for attempt in (answer.QuoteAttempt(loop, True),  # a loop, even one that closed
                    answer.QuoteAttempt("Annual subscriptions have 30 calendar days to ask and", False),  # no mark
                    answer.QuoteAttempt("30 days", True)):  # too short to check
        c = answer.quote_citation(attempt, docs)
        assert c.state == "no_usable_quote" and not c.verified and c.doc_id is None
    missing = answer.quote_citation(answer.QuoteAttempt("Annual plans have 14 days to ask", True), docs)
    assert missing.state == "not_found" and not missing.verified


def test_a_passage_found_by_search_is_labelled_so_never_verified(kb) -> None:
    prep = answer.prepare(kb, "How many days for a refund?", "support")
    cites = answer.with_support([answer.quote_citation(answer.QuoteAttempt("x x x x x x x x", False), [])],
                                prep.sources, "refund days")
    assert [c.state for c in cites] == ["no_usable_quote", "retrieved"]
    assert cites[1].source == "retrieval" and not cites[1].verified and cites[1].as_dict()["state"] == "retrieved"


def test_a_truncated_answer_reports_length(kb) -> None:
    kb.build("support")
    a = kb.ask("How long is the refund window?", "support", max_tokens=2, quote=True)
    # the tiny model's characters never include a newline, so only the token limit ends it
    assert a.finish_reason == "length" and a.as_dict()["finish_reason"] == "length"
    assert all(c.state in ("verified", "not_found", "no_usable_quote", "retrieved") for c in a.citations)


def test_block_hashes_are_safe_to_ask_for_from_two_threads(kb) -> None:
    """The server's HTTP threads and its worker both ask: the memo must never lose or mix an entry."""
    cache = kb.engine.cache
    prefixes = [tuple(range(1, 1 + 16 * (i % 5 + 1))) + (i,) * 16 for i in range(80)]  # more than the memo keeps
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(3):
                for p in prefixes:
                    assert len(cache.block_hashes(p)) == len(p) // 16
        except BaseException as e:  # noqa: BLE001 (any failure of a thread fails the test)
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    fresh = type(cache)(cache.model, cache.fingerprint, cache.store, cache.preamble, 16, cache.kv_dtype)
    assert all(cache.block_hashes(p) == fresh.block_hashes(p) for p in prefixes[-5:])
