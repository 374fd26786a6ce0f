"""The server on a real loopback socket, over a tiny random model (one that never emits EOS)."""

import asyncio
import dataclasses
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from chartok import CharTokenizer
from kbdata import write_kb
from serverutil import serving

from kvfuse.engine import Engine
from kvfuse.kb.base import KnowledgeBase
from kvfuse.server.app import Limits, ServerState, create_app
from kvfuse.server.auth import Keys
from kvfuse.store import open_store
from kvfuse.weights import load_model

KEYS = """
[[keys]]
key = "sk-support-000"
tenant = "acme"
[keys.kb]
demo = ["support"]

[[keys]]
key = "sk-leads-00000"
tenant = "acme"
admin = true
[keys.kb]
demo = ["leads", "support"]

[[keys]]
key = "sk-nokb-000000"
tenant = "beta"

[[keys]]
key = "sk-beta-support"
tenant = "beta"
[keys.kb]
demo = ["support"]

[[keys]]
key = "sk-admin-support"
tenant = "acme"
admin = true
[keys.kb]
demo = ["support"]
"""
SUPPORT = {"Authorization": "Bearer sk-support-000"}
LEADS = {"Authorization": "Bearer sk-leads-00000"}
NOKB = {"Authorization": "Bearer sk-nokb-000000"}
ADMIN_SUPPORT = {"Authorization": "Bearer sk-admin-support"}
BETA = {"Authorization": "Bearer sk-beta-support"}


def _serve(tiny_models, tmp, keys: bool | str = True, tok=None, **limits):  # type: ignore[no-untyped-def]
    """A server over its own copy of the demo knowledge base and its own store (`limits` override the
    tests' Limits; `tok` replaces the character tokenizer; `keys=False` serves without keys, a string
    is the keys.toml to serve with)."""
    root, _ = tiny_models["gemma3"]
    lm = load_model(root)
    write_kb(tmp / "kb")
    (tmp / "keys.toml").write_text(keys if isinstance(keys, str) else KEYS)
    engine = Engine(lm.model, lm.fingerprint, store=open_store(tmp / "store", lm.fingerprint))
    engine.cfg = dataclasses.replace(engine.cfg, eos_token_ids=())  # generations always run to max_tokens
    tok = tok or CharTokenizer()
    kb = KnowledgeBase.open(tmp / "kb", engine, tok, state_dir=tmp / "store")
    lim = Limits(**{"max_documents": 3, "max_document_tokens": 120, "max_queue": 4, **limits})
    state = ServerState(engine, tok, "tiny", {"demo": kb}, Keys.load(tmp / "keys.toml") if keys else None, lim)
    return serving(create_app(state)), state


@pytest.fixture(scope="module")
def srv(tiny_models, tmp_path_factory):  # type: ignore[no-untyped-def]
    """Shared by the tests that read; a test that edits the knowledge base takes `own_srv`."""
    ctx, state = _serve(tiny_models, tmp_path_factory.mktemp("server"))
    with ctx as url:
        yield url, state


@pytest.fixture
def own_srv(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    ctx, state = _serve(tiny_models, tmp_path)
    with ctx as url:
        yield url, state


def client(srv, headers=SUPPORT) -> httpx.Client:  # type: ignore[no-untyped-def]
    return httpx.Client(base_url=srv[0], headers=headers, timeout=60)


def test_openai_client_completions_and_chat(srv) -> None:
    import openai

    oc = openai.OpenAI(base_url=srv[0] + "/v1", api_key="sk-support-000")
    assert [m.id for m in oc.models.list().data] == ["tiny"]
    c = oc.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 6
    assert c.usage.prompt_tokens == 1 + len("Once upon a time")
    streamed = oc.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0,
                                     stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == c.choices[0].text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    chat = oc.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    parts = list(oc.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert text == chat.choices[0].message.content
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 5
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"


def test_conversations_reuse_their_prefix(srv) -> None:
    with client(srv) as h:
        turn1 = [{"role": "user", "content": "Tell me about the plans and the billing rules, please."}]
        r1 = h.post("/v1/chat/completions", json={"messages": turn1, "max_tokens": 4, "temperature": 0}).json()
        turn2 = turn1 + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And then?"}]
        r2 = h.post("/v1/chat/completions", json={"messages": turn2, "max_tokens": 4, "temperature": 0}).json()
    # request 1's prompt is a token prefix of request 2's, so its blocks (all but the generation prompt,
    # which is never cached) are reused
    gen = len(srv[1].chat.generation_prompt(srv[1].tok))
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == (r1["usage"]["prompt_tokens"] - gen) // 16 * 16


def test_documents_are_cached_on_first_sight(srv) -> None:
    body = {"prompt": "Question: what is the code?\nAnswer:", "max_tokens": 3, "temperature": 0,
            "documents": [{"id": "a", "text": "The door code is 4812. " * 3}, {"text": "The safe is in room 7. " * 3}]}
    with client(srv) as h:
        first = h.post("/v1/completions", json=body).json()
        second = h.post("/v1/completions", json=body).json()
        exact = h.post("/v1/completions", json={**body, "kvfuse": {"mode": "blend", "ratio": 1.0}}).json()
        full = h.post("/v1/completions", json={**body, "kvfuse": {"mode": "full"}}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["kvfuse"]["mode"] == "queryaware" and second["kvfuse"]["recomputed_tokens"] > 0
    assert second["kvfuse"]["fuser"].startswith("queryaware:weigh=") and exact["kvfuse"]["fuser"] == "blend"
    assert exact["choices"][0]["text"] == full["choices"][0]["text"]


def test_greedy_answers_are_the_same_with_and_without_drafts(srv) -> None:
    engine = srv[1].engine
    body = {"prompt": "one two three four five. one two three four five. one two three", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    with client(srv) as h:
        drafted = h.post("/v1/completions", json=body).json()
        engine.draft_tokens, was = 0, engine.draft_tokens
        try:
            plain = h.post("/v1/completions", json=body).json()
        finally:
            engine.draft_tokens = was
    d = drafted["kvfuse"]["drafts"]
    assert d["drafted"] > 0 and 0 <= d["accepted"] <= d["drafted"] and plain["kvfuse"]["drafts"]["drafted"] == 0
    assert drafted["choices"][0]["text"] == plain["choices"][0]["text"]


def test_knowledge_base_extension_and_groups(srv) -> None:
    url, state = srv
    kb = state.kbs["demo"]
    body = {"messages": [{"role": "user", "content": "What is the margin?"}], "kb": "demo", "max_tokens": 4,
            "temperature": 0}
    with client(srv) as h:
        r = h.post("/v1/chat/completions", json=body).json()
        again = h.post("/v1/chat/completions", json=body).json()
        forbidden = h.post("/v1/chat/completions", json={**body, "kvfuse": {"group": "leads"}})
    support = kb.plan("support", "acme")
    readable = {d.id for d in kb.manifest.readable("support")}  # citations never name a leads-only document
    assert r["kvfuse"]["group"] == "support" and "margins" not in readable
    assert all(c["doc_id"] in readable or c["doc_id"] is None for c in r["kvfuse"]["citations"])
    assert r["usage"]["prompt_tokens"] > len(support.ids) and "margins" not in {s.name for s in support.segments}
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(support.ids) // 16 * 16
    assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"
    with client(srv, LEADS) as h:
        lead = h.post("/v1/chat/completions", json={**body, "kvfuse": {"group": "leads"}}).json()
    assert lead["kvfuse"]["group"] == "leads" and lead["usage"]["prompt_tokens"] > r["usage"]["prompt_tokens"]


def test_auth(srv) -> None:
    with httpx.Client(base_url=srv[0]) as h:
        for headers in ({}, {"Authorization": "Bearer wrong-key-123"}, {"Authorization": "sk-support-000"}):
            r = h.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert h.get("/v1/models").status_code == 401
        assert h.get("/health").status_code == 200
    with client(srv, NOKB) as h:
        r = h.post("/v1/completions", json={"prompt": "hi", "kb": "demo", "max_tokens": 1})
        assert r.status_code == 404 and "not available to this key" in r.json()["error"]["message"]
        assert h.get("/v1/kb/demo").status_code == 404


def test_kb_endpoints(own_srv) -> None:
    srv = own_srv
    with client(srv) as h:
        stats = h.get("/v1/kb/demo").json()
        assert set(stats["groups"]) == {"support"} and "margins" not in {d["id"] for d in stats["documents"]}
        r = h.post("/v1/kb/demo/documents", json={"id": "faq", "text": "Refunds: 15 days."})
        assert r.status_code == 403
    with client(srv, LEADS) as h:
        ask = {"kb": "demo", "prompt": "Refund?", "max_tokens": 1, "kvfuse": {"group": "support"}}
        assert h.post("/v1/completions", json=ask).status_code == 200  # an edit rebuilds only prefixes read
        r = h.post("/v1/kb/demo/documents", json={"id": "news", "text": "New office opens in May.",
                                                  "groups": ["support"]})
        assert r.status_code == 200 and r.json()["created"] and r.json()["builds"][0]["group"] == "support"
        upd = h.post("/v1/kb/demo/documents", json={"id": "news", "text": "Our new office opens in May."}).json()
        assert not upd["created"] and 0 < upd["builds"][0]["tokens_recomputed"] < upd["builds"][0]["tokens_total"]
        assert h.delete("/v1/kb/demo/documents/nope").status_code == 404
        assert h.delete("/v1/kb/demo/documents/news").json()["deleted"]
        assert "news" not in {d["id"] for d in h.get("/v1/kb/demo").json()["documents"]}
        bad = h.post("/v1/kb/demo/documents", json={"id": "bad id!", "text": "x"})
        assert bad.status_code == 400


@pytest.mark.parametrize("body,status,fragment", [
    ({"prompt": "x" * 600, "max_tokens": 4}, 400, "maximum context length is 512"),
    ({"prompt": "hi", "kvfuse": {"ratio": 1.5}}, 400, "ratio"),
    ({"prompt": "hi", "kvfuse": {"mode": "fast"}}, 400, "mode"),
    ({"prompt": "hi", "documents": [{"text": "a"}] * 4}, 400, "at most 3"),
    ({"prompt": "hi", "documents": [{"text": "a" * 200}]}, 400, "at most 120"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": "hi", "kb": "nope"}, 404, "does not exist"),
    ({"prompt": "hi", "n": 2}, 400, "'n'"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": [1, 2, 999]}, 400, "outside the vocabulary"),
    ({"prompt": "hi", "kvfuse": {"mode": "prefix", "ratio": 0.2}}, 400, "only to mode 'blend'"),
    ({"messages": []}, 400, "messages"),
])
def test_bad_input_gets_openai_errors(srv, body, status, fragment) -> None:  # type: ignore[no-untyped-def]
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with client(srv) as h:
        r = h.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_malformed_json_and_server_survives(srv) -> None:
    with client(srv) as h:
        r = h.post("/v1/completions", content=b'{"prompt": "hi",', headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] is None  # not a character offset
        assert h.post("/v1/completions", content=b"[1, 2]").status_code == 400
        assert h.get("/health").json()["status"] == "ok"


def test_metrics(srv) -> None:
    with client(srv) as h:
        h.post("/v1/completions", json={"prompt": "metrics please", "max_tokens": 2})
        text = h.get("/metrics").text
    for name in ("kvfuse_ttft_seconds_bucket", "kvfuse_prompt_tokens_total", "kvfuse_cached_tokens_total",
                 "kvfuse_recomputed_tokens_total", "kvfuse_store_hits_total", "kvfuse_store_misses_total",
                 "kvfuse_store_evictions_total", 'kvfuse_store_bytes{tier="memory"}', 'kvfuse_store_bytes{tier="disk"}',
                 "kvfuse_queue_depth"):
        assert name in text, name
    count = next(line for line in text.splitlines() if line.startswith("kvfuse_ttft_seconds_count"))
    assert float(count.split()[-1]) >= 1


def test_parallel_requests_answer_like_sequential_ones(srv) -> None:
    bodies = [{"prompt": f"Case {i}: the answer is", "max_tokens": 5, "temperature": 0.8, "seed": i} for i in range(4)]

    def send(body):  # type: ignore[no-untyped-def]
        with client(srv) as h:
            return h.post("/v1/completions", json=body).json()["choices"][0]["text"]

    one_by_one = [send(b) for b in bodies]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(send, bodies))
    assert together == one_by_one


def test_full_queue_gets_429_with_retry_after(srv) -> None:
    url, state = srv
    w = state.worker
    gate, loop = threading.Event(), asyncio.new_event_loop()

    async def fill() -> None:  # occupy every place in the queue: one job runs (and waits), the rest queue
        for _ in range(w.max_queue):
            w.submit(lambda cancel, emit: gate.wait(10))

    loop.run_until_complete(fill())
    assert w.depth == w.max_queue
    try:
        with client(srv) as h:
            r = h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        gate.set()
    for _ in range(200):
        if w.depth == 0:
            break
        threading.Event().wait(0.05)
    assert w.depth == 0


def test_disconnect_cancels_the_work(srv) -> None:
    url, state = srv

    def completion_tokens() -> float:
        text = httpx.get(url + "/metrics", headers=SUPPORT).text
        return float(next(x for x in text.splitlines() if x.startswith("kvfuse_completion_tokens_total")).split()[-1])

    before = completion_tokens()
    body = {"prompt": "Go on and on:", "max_tokens": 400, "stream": True, "temperature": 0}
    with httpx.Client(base_url=url, headers=SUPPORT, timeout=60) as h, h.stream("POST", "/v1/completions",
                                                                                json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token arrived: hang up
    for _ in range(400):
        if state.worker.depth == 0:
            break
        threading.Event().wait(0.05)
    spent = completion_tokens() - before
    assert 0 < spent < 400, spent


def test_openapi_is_served(srv) -> None:
    spec = httpx.get(srv[0] + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
            "/v1/kb/{name}/documents", "/v1/kb/{name}/documents/{doc_id}", "/v1/kb/{name}"} <= set(spec["paths"])
    from kvfuse.fuse import modes

    mode = spec["components"]["schemas"]["KvfuseOptions"]["properties"]["mode"]
    assert [a for a in mode["anyOf"] if "enum" in a][0]["enum"] == list(modes()) == ["full", "prefix", "reuse", "blend",
                                                                                 "legolink", "queryaware"]


def test_tenants_never_hit_each_others_prompts(srv) -> None:
    body = {"prompt": "A private prompt of tenant acme, long enough to fill some blocks.", "max_tokens": 1}
    with client(srv) as h:
        h.post("/v1/completions", json=body)
        again = h.post("/v1/completions", json=body).json()
    with client(srv, NOKB) as h:
        other = h.post("/v1/completions", json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def _cached(srv, headers, body: dict) -> int:  # type: ignore[no-untyped-def]
    with client(srv, headers) as h:
        r = h.post("/v1/completions", json={"max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("tenant_wide", [False, True])
def test_a_group_reads_nothing_another_group_of_its_tenant_sent(tiny_models, tmp_path, tenant_wide) -> None:
    """Issue Q.2: acme's support and leads keys. What a support request brings (a plain prompt, or
    documents beside a kb question) is never a cache hit for leads, unless keys.toml opts acme into a
    tenant-wide cache; a second key of the same group shares it either way."""
    leads_only = KEYS.replace('demo = ["leads", "support"]', 'demo = ["leads"]')
    keys = leads_only + ('\n[tenants.acme]\ncache = "tenant"\n' if tenant_wide else "")
    ctx, _ = _serve(tiny_models, tmp_path, keys)
    with ctx as url:
        srv = (url, None)
        prompt = {"prompt": "A support agent's own prompt, long enough to fill a few blocks of the cache."}
        cold = {"prompt": "A prompt that nobody has sent before, of the very same length as the others."}
        assert len(prompt["prompt"]) == len(cold["prompt"])
        assert _cached(srv, SUPPORT, prompt) == 0 and _cached(srv, SUPPORT, prompt) >= 64
        assert _cached(srv, ADMIN_SUPPORT, prompt) >= 64  # the same group: shared
        assert _cached(srv, LEADS, prompt) == (_cached(srv, SUPPORT, prompt) if tenant_wide else 0)
        assert _cached(srv, NOKB, prompt) == 0  # another tenant: never
        docs = [{"text": "Internal note: the Q3 discount for Northwind is 18 percent, approved by finance."}]
        fresh = [{"text": "Internal note: the Q4 discount for Southwind is 12 percent, approved by the CFO."}]
        assert len(docs[0]["text"]) == len(fresh[0]["text"])
        _cached(srv, SUPPORT, {"kb": "demo", "prompt": "Discount?", "documents": docs})
        _cached(srv, LEADS, {"kb": "demo", "prompt": "Discount?"})  # leads' own prefix, built
        leads_seen = _cached(srv, LEADS, {"kb": "demo", "prompt": "Discount?", "documents": docs})
        leads_new = _cached(srv, LEADS, {"kb": "demo", "prompt": "Discount?", "documents": fresh})
        # the documents' cache is support's own: leads computes them as it computes ones nobody sent
        assert (leads_seen > leads_new) if tenant_wide else (leads_seen == leads_new), (leads_seen, leads_new)


def test_keys_toml_tenant_cache_flag_is_checked(tmp_path) -> None:
    from kvfuse.server.auth import KeysError

    for bad in ('[tenants.acme]\ncache = "global"\n', '[tenants.acme]\nshare = true\n', 'tenants = 3\n'):
        (tmp_path / "k.toml").write_text(KEYS + bad)
        with pytest.raises(KeysError, match="tenant"):
            Keys.load(tmp_path / "k.toml")
    (tmp_path / "k.toml").write_text(KEYS + '[tenants.acme]\ncache = "tenant"\n[tenants.beta]\ncache = "group"\n')
    keys = Keys.load(tmp_path / "k.toml")
    assert keys.lookup(SUPPORT["Authorization"]).tenant_wide and not keys.lookup(BETA["Authorization"]).tenant_wide


def test_admins_edit_only_their_groups_and_bad_documents_change_nothing(own_srv) -> None:
    srv = own_srv
    url, state = srv
    kb = state.kbs["demo"]
    manifest_before = (kb.manifest.root / "kb.toml").read_text()
    with client(srv, ADMIN_SUPPORT) as h:
        r = h.post("/v1/kb/demo/documents", json={"id": "x", "text": "hi", "groups": ["leads"]})
        assert r.status_code == 403
        assert h.delete("/v1/kb/demo/documents/margins").status_code == 404  # a leads document is invisible
        assert h.post("/v1/kb/demo/documents", json={"id": "margins", "text": "mine now"}).status_code == 404
    with client(srv, LEADS) as h:
        for bad in ({"id": "g", "text": "x", "groups": ["../../etc"]}, {"id": "t", "text": "x", "title": "a\x00b"},
                    {"id": "long", "text": "y" * 600}):
            r = h.post("/v1/kb/demo/documents", json=bad)
            assert r.status_code in (400, 403), (bad, r.text)  # a group outside the key's is refused first
    assert (kb.manifest.root / "kb.toml").read_text() == manifest_before
    assert not (kb.manifest.root / "docs" / "long.md").exists()


def test_unsupported_and_null_parameters(srv) -> None:
    with client(srv) as h:
        r = h.post("/v1/completions", json={"prompt": "hi", "echo": True, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
        ok = h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "temperature": None, "top_p": None,
                                             "n": None, "stream": None, "logprobs": None, "echo": False})
        assert ok.status_code == 200, ok.text
        assert h.post("/v1/completions", json={"prompt": "hi", "seed": 2**64}).status_code == 400
        assert h.post("/v1/completions", json={"prompt": "hi", "kvfuse": {"quote": True}}).status_code == 400


def test_a_tenant_gets_the_same_cache_keys_from_the_library_and_the_server(srv) -> None:
    """One salt type: the server stores a tenant's chunk and prefix blocks under exactly the keys the
    library (`kb.answer.prepare`, what `kvfuse ask` runs) computes for that tenant."""
    from kvfuse.fuse import DEFAULT_MODE, get_fuser
    from kvfuse.kb import answer
    from kvfuse.rag.index import IndexChunk

    url, state = srv
    kb, eng = state.kbs["demo"], state.engine
    text = "Ticket 9001: the customer asks about the refund window for annual plans."
    passage = IndexChunk("t9001", "", (), 0, len(text), text)  # untitled: its prompt text is the text itself
    lib = answer.prepare(kb, "Refund?", "support", "acme", [passage])
    chunk = lib.request.chunks[0]
    (behind,) = eng.cache.chunk_preambles(get_fuser(DEFAULT_MODE), lib.request)  # what the server's mode reads
    tenant_key = eng.cache.chunk_key(chunk, lib.request.chunk_salt, behind)
    shared_key = eng.cache.chunk_key(chunk, None, behind)
    assert tenant_key != shared_key and tenant_key not in eng.store
    with client(srv) as h:  # SUPPORT is tenant acme
        r = h.post("/v1/completions", json={"kb": "demo", "prompt": "Refund?", "max_tokens": 1,
                                            "documents": [{"text": text}]})
    assert r.status_code == 200, r.text
    assert tenant_key in eng.store and shared_key not in eng.store
    plan = kb.plan("support", "acme")
    assert all(h in eng.store for h in eng.cache.block_hashes(plan.ids, lib.request.salts))
    assert eng.cache.block_hashes(plan.ids, plan.salts) != eng.cache.block_hashes(kb.plan("support").ids,
                                                                                   kb.plan("support").salts)


def test_ratio_auto_works_over_http_with_the_controller(srv) -> None:
    from kvfuse.policy import Controller, Profile, TierProfile

    url, state = srv
    eng = state.engine
    body = {"prompt": "What is the code?", "max_tokens": 1, "documents": [{"text": "The door code is 7310. " * 2}],
            "kvfuse": {"mode": "blend", "ratio": "auto"}}
    with client(srv, NOKB) as h:
        assert h.post("/v1/completions", json=body).status_code == 400  # no controller: 'auto' is refused
        tiers = {"memory": TierProfile(1e9, 4.0), "disk": TierProfile(1e6, 0.1)}
        eng.controller = Controller(Profile("tiny", "test", 4096, {16: 1e-4, 64: 1e-4}, tiers), floor=0.2)
        try:
            r = h.post("/v1/completions", json=body).json()
        finally:
            eng.controller = None
    ctl = r["kvfuse"]["controller"]
    assert ctl is not None and ctl["ratio"] == pytest.approx(r["kvfuse"]["ratio"], abs=1e-4)
    assert r["kvfuse"]["ratio"] >= 0.2  # never below the floor


def test_a_lone_surrogate_anywhere_gets_a_400_and_the_connection_lives(srv) -> None:
    """JSON can carry a lone surrogate, which no tokenizer takes: a 400 naming it, never a 500, and the
    same keep-alive connection serves the next request."""
    bad = "abc\ud800"
    bodies = [("/v1/completions", {"prompt": bad, "max_tokens": 1}),
              ("/v1/completions", {"prompt": ["x", bad], "max_tokens": 1}),
              ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": [bad]}),
              ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "documents": [{"text": bad}]}),
              ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "kb": bad}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": bad}], "max_tokens": 1}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": bad}]}],
                                        "max_tokens": 1})]
    with client(srv) as h:
        for path, body in bodies:
            r = h.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (body, r.text)
            message = r.json()["error"]["message"]  # ours, or pydantic's where its JSON parser refuses first
            assert "lone surrogate (U+D800) at character 3" in message or "unicode string" in message, r.text
            ok = h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert ok.status_code == 200, ok.text


def test_logit_bias_and_penalties_change_the_output_and_images_are_refused(srv) -> None:
    """logit_bias bans what greedy would print; penalties steer off repeats; out-of-range values, keys that
    are not token ids or are outside the vocabulary get a 400; image parts are refused, never dropped."""
    tok = srv[1].tok
    with client(srv) as h:
        ask = {"prompt": "The office", "max_tokens": 6, "temperature": 0}
        plain = h.post("/v1/completions", json=ask).json()["choices"][0]["text"]
        first = [i for i in range(128) if tok.decode([i]) == plain[0]]  # every id that prints its first char
        banned = h.post("/v1/completions", json={**ask, "logit_bias": {str(i): -100 for i in first}}).json()
        assert banned["choices"][0]["text"][0] != plain[0]
        pen = h.post("/v1/completions", json={**ask, "frequency_penalty": 2.0, "presence_penalty": 2.0}).json()
        assert len(set(plain)) == len(plain) or pen["choices"][0]["text"] != plain  # repeats now cost
        for extra, param in (({"logit_bias": {"11": -101}}, "logit_bias"), ({"logit_bias": {"comma": 1}},
                             "logit_bias"), ({"logit_bias": {"100000": 1}}, "logit_bias"),
                             ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3},
                                                                               "frequency_penalty")):
            r = h.post("/v1/completions", json={**ask, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        r = h.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]})
        assert r.status_code == 400 and "image_url" in r.json()["error"]["message"], r.text
        neutral = {"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0}  # no change
        same = h.post("/v1/completions", json={**ask, **neutral}).json()["choices"][0]["text"]
        assert same == plain


def test_the_bearer_scheme_is_case_insensitive(srv) -> None:
    with httpx.Client(base_url=srv[0]) as h:
        for scheme in ("bearer", "BEARER", "Bearer"):
            r = h.get("/v1/models", headers={"Authorization": f"{scheme} sk-support-000"})
            assert r.status_code == 200, scheme
        assert h.get("/v1/models", headers={"Authorization": "Basic sk-support-000"}).status_code == 401


def test_logprobs_in_openai_shapes_streamed_and_not(srv) -> None:
    """Issue N.3: logprobs and top_logprobs through the real openai client, in chat and completions,
    streamed and not: one entry per completion token, whose texts make up the text, alternatives sorted
    (a greedy token is the most likely), offsets into the text; bad values get a 400 saying what to fix."""
    import openai

    oc = openai.OpenAI(base_url=srv[0] + "/v1", api_key="sk-support-000")
    msgs = [{"role": "user", "content": "Hello there"}]
    chat = oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                      top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and bytes(c.bytes).decode() == c.token and len(c.top_logprobs) == 3
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob)  # greedy: the most likely one
    parts = list(oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for p in parts if p.choices and p.choices[0].logprobs for c in p.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]  # (the second reads the cached prompt)
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content
    comp = oc.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(t) <= 2 and max(t.values()) == pytest.approx(v) for t, v in zip(lp.top_logprobs, lp.token_logprobs,
                                                                                   strict=True))
    chunks = list(oc.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0,
                                        logprobs=2, stream=True))
    got = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((g.tokens for g in got), []) == lp.tokens and sum((g.text_offset for g in got), []) == lp.text_offset
    kb = oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0.3, seed=1,
                                    logprobs=True, top_logprobs=1, extra_body={"kb": "demo"})
    assert len(kb.choices[0].logprobs.content) == kb.usage.completion_tokens == 4  # a kb request, sampled
    assert all(len(c.top_logprobs) == 1 and c.logprob <= c.top_logprobs[0].logprob + 1e-6
               for c in kb.choices[0].logprobs.content)
    with client(srv) as h:
        for body, path in (({"messages": msgs, "logprobs": True, "top_logprobs": 21}, "/v1/chat/completions"),
                           ({"messages": msgs, "top_logprobs": 2}, "/v1/chat/completions"),
                           ({"prompt": "hi", "logprobs": True}, "/v1/completions"),
                           ({"prompt": "hi", "logprobs": 30}, "/v1/completions")):
            r = h.post(path, json={**body, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_logprobs", (body, r.text)
            assert "logprobs" in r.json()["error"]["message"]


def test_response_format_is_checked_before_it_queues(srv) -> None:
    """An invalid schema or type gets a 400 naming the problem; this test server's character tokenizer
    cannot compile a grammar, and says so (the real model's tests run the grammar)."""
    with client(srv) as h:
        for fmt, words in (({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
                            "schema is invalid"),
                           ({"type": "yaml"}, "not one of text, json_object, json_schema"),
                           ({"type": "json_schema", "json_schema": "nope"}, "needs"),
                           ({"type": "json_object"}, "cannot compile a grammar")):
            r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "response_format": fmt, "max_tokens": 2})
            assert r.status_code == 400 and words in r.json()["error"]["message"], (fmt, r.text)
            assert r.json()["error"]["param"] == "response_format"
        ok = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "response_format": {"type": "text"}, "max_tokens": 2})
        assert ok.status_code == 200


def test_loose_types_and_a_body_that_is_not_utf8_get_a_400_that_says_what_to_fix(srv) -> None:
    """Types are strict, as OpenAI's API: a string where an integer or a boolean goes is refused, naming
    the field; a body that is not UTF-8 is refused saying so and where; an integer is still a number."""
    with client(srv) as h:
        for body, field in (({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
                            ({"prompt": "hi", "max_tokens": 1, "stream": "yes"}, "stream"),
                            ({"prompt": "hi", "max_tokens": 1, "kvfuse": {"quote": "true"}}, "kvfuse.quote"),
                            ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.0}, "max_tokens")):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = h.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == field, r.text
        assert h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "temperature": 0}).status_code == 200
        raw = b'{"prompt": "caf\xe9", "max_tokens": 1}'
        r = h.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("The request body is not UTF-8: byte 0xe9 at offset 15"), r.text
