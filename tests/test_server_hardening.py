"""Issue K's defects, each through the HTTP API on a real loopback socket: body limits, a maximal body
that stalls nothing, every response counted, TTFT with its queue, the OpenAPI schema and local docs,
/metrics behind a key, and knowledge-base edits that rebuild what requests read."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serverutil import samples
from test_server import BETA, LEADS, SUPPORT, _serve, client

from kvfuse.kb.build import built_prefixes
from kvfuse.server.app import Limits


def _server(tiny_models, tmp, keys: bool = True, tok=None, **limits):  # type: ignore[no-untyped-def]
    return _serve(tiny_models, tmp, keys, tok, **{"max_queue": 8, **limits})


@pytest.fixture(scope="module")
def srv(tiny_models, tmp_path_factory):  # type: ignore[no-untyped-def]
    ctx, state = _serve(tiny_models, tmp_path_factory.mktemp("hardening"))
    with ctx as url:
        yield url, state


def _metric(url: str, name: str, headers: dict[str, str] = SUPPORT) -> dict[str, float]:
    return samples(httpx.get(url + "/metrics", headers=headers).text, name)


def test_bodies_past_the_limit_get_413_before_they_are_read(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ctx, state = _server(tiny_models, tmp_path, max_body_bytes=50_000)
    with ctx as url, client((url, state)) as h:
        big = json.dumps({"prompt": "x" * 60_000, "max_tokens": 1})
        t0 = time.perf_counter()
        r = h.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        assert "--max-body-bytes" in r.json()["error"]["message"] and time.perf_counter() - t0 < 2

        def chunks():  # type: ignore[no-untyped-def]  # no Content-Length: read up to the limit, no further
            for i in range(0, len(big), 4096):
                yield big[i : i + 4096].encode()

        r = h.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text
        ok = h.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1})
        assert ok.status_code == 200 and h.get("/health").json()["status"] == "ok"
        got = _metric(url, "kvfuse_requests_total")
        assert got.get("endpoint=/v1/completions,status=413") == 2, got
    default = Limits().body_limit(32768)
    assert default == 16 * (32768 + 16 * 4096) + (64 << 10)  # sized from the window and the documents allowed


@pytest.mark.slow
def test_a_maximal_body_stalls_neither_a_stream_nor_health(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One client sends a body at the limit (6 MB of chat messages, which take seconds to tokenise and get
    a 400 for the window), one streams, one polls /health: /health stays under 200 ms and the stream
    never stalls for the tokenising, because it runs off the event loop. The real (Rust) tokenizer
    of the default model, over the tiny model (the stream's prompt is token ids); the pure-Python test
    tokenizer would hold the GIL and slow the worker's many small ops, which no real tokenizer does."""
    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.text.tokenizer import Tokenizer

    ctx, state = _server(tiny_models, tmp_path, keys=False, tok=Tokenizer(resolve_model_path(None)),
                         max_body_bytes=7 << 20)
    words = " ".join(f"policy{i} refunds" for i in range(18_000))  # ~350k characters of varied text
    body = json.dumps({"messages": [{"role": "user", "content": words}] * 15, "max_tokens": 1})
    assert len(body) < 7 << 20
    state.engine.decode_batch_limit()  # checked (or read) before the stream, not in its first steps
    with ctx as url:
        streaming, sent, done = threading.Event(), threading.Event(), threading.Event()
        gaps: list[float] = []
        health: list[float] = []
        took: list[float] = []

        def stream() -> None:
            with httpx.Client(base_url=url, timeout=60) as h, h.stream(
                    "POST", "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 400, "stream": True}) as r:
                last = None
                for line in r.iter_lines():
                    now = time.perf_counter()
                    if line.startswith("data: {") and last is not None and sent.is_set() and not done.is_set():
                        gaps.append(now - last)
                    last = now
                    streaming.set()

        def poll() -> None:
            with httpx.Client(base_url=url, timeout=60) as h:
                while not done.is_set():
                    t0 = time.perf_counter()
                    assert h.get("/health").status_code == 200
                    health.append(time.perf_counter() - t0)
                    time.sleep(0.01)

        def maximal() -> int:
            with httpx.Client(base_url=url, timeout=60) as h:
                assert streaming.wait(60)  # sent while the stream runs (400 steps of the tiny model)
                t0 = time.perf_counter()
                sent.set()
                r = h.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
                took.append(time.perf_counter() - t0)
                done.set()
                return r.status_code

        with ThreadPoolExecutor(3) as pool:
            s, p, m = pool.submit(stream), pool.submit(poll), pool.submit(maximal)
            assert m.result() == 400
            s.result()
            p.result()
    print(f"maximal body: {took[0]:.3f} s; stream gaps max {max(gaps):.3f} s over {len(gaps)}; /health max "
          f"{max(health):.3f} s over {len(health)}")
    assert took[0] > 0.2 and len(gaps) > 5 and len(health) > 5  # it overlapped them for a while
    assert max(health) < 0.2, f"/health took {max(health):.3f} s during the maximal body"
    # in this one process the client threads share the GIL and 2 cores with the server, and the stream's
    # gaps reach 0.1-0.5 s; with the tokenising on the event loop they would last the whole ~4 s. The
    # 200 ms target is measured with separate processes and the real model: benchmarks/max_body.py.
    assert max(gaps) < 1.0, f"a stream gap of {max(gaps):.3f} s during the maximal body"


def test_every_response_is_counted_by_status(tiny_models, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    ctx, state = _server(tiny_models, tmp_path, max_body_bytes=20_000)
    with ctx as url, client((url, state)) as h:
        assert h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
        assert h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}).status_code == 400  # validation
        assert h.post("/v1/completions", content=b"{", headers={"Content-Type": "application/json"}).status_code == 400
        assert h.post("/v1/completions", json={"prompt": "hi", "model": "gpt"}).status_code == 404
        assert h.post("/v1/completions", json={"prompt": "y" * 30_000}).status_code == 413
        assert h.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert h.get("/nowhere").status_code == 404

        def broken(*a, **k):  # type: ignore[no-untyped-def]
            raise TypeError("a bug")

        monkeypatch.setattr(state.engine, "validate", broken)
        assert h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 500
        assert h.get("/health").status_code == 200  # a bug answers 500 and the server goes on
        got = _metric(url, "kvfuse_requests_total")
    want = {"/v1/completions": {"200": 1, "400": 2, "404": 1, "413": 1, "500": 1}, "/v1/models": {"401": 1},
            "unmatched": {"404": 1}, "/health": {"200": 1}}
    for endpoint, by_status in want.items():
        for status, n in by_status.items():
            assert got.get(f"endpoint={endpoint},status={status}") == n, (endpoint, status, got)


def test_client_ttft_includes_the_queue(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ctx, state = _server(tiny_models, tmp_path, keys=False, max_batch=1)
    with ctx as url:
        def ask(n: int) -> dict:  # type: ignore[type-arg]
            with httpx.Client(base_url=url, timeout=60) as h:
                return h.post("/v1/completions", json={"prompt": "hello", "max_tokens": n}).json()["kvfuse"]  # type: ignore[no-any-return]

        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(ask, 300)
            time.sleep(0.2)
            short = pool.submit(ask, 1).result()
            first = long.result()
        engine_sum = _metric(url, "kvfuse_ttft_seconds_sum")[""]
        client_sum = _metric(url, "kvfuse_client_ttft_seconds_sum")[""]
        count = _metric(url, "kvfuse_client_ttft_seconds_count")[""]
    assert short["queue_s"] > 0.1  # it waited for the long one (one request at a time here)
    assert short["client_ttft_s"] >= short["queue_s"] + short["ttft_s"] * 0.99 and short["ttft_s"] < 0.1
    assert first["client_ttft_s"] >= first["ttft_s"]
    assert count == 2 and client_sum >= engine_sum + 0.1


def test_openapi_declares_the_bearer_scheme_and_400s_and_docs_are_local(srv) -> None:  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=srv[0], timeout=30) as h:
        spec = h.get("/openapi.json").json()
        assert spec["components"]["securitySchemes"]["bearer"] == {
            "type": "http", "scheme": "bearer", "description": "an API key from the --keys file"}
        for path, ops in spec["paths"].items():
            for method, op in ops.items():
                assert "422" not in op["responses"], (path, method)
                if method == "post":
                    assert {"400", "413"} <= set(op["responses"]), (path, method)
                assert ("security" in op) == (path != "/health"), (path, method)
        for page, asset in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
            html = h.get(page).text
            assert f"/static-offline-docs/{asset}" in html and "cdn" not in html.lower(), page
            js = h.get(f"/static-offline-docs/{asset}")
            assert js.status_code == 200 and len(js.content) > 100_000


def test_metrics_need_a_key_unless_public(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ctx, state = _server(tiny_models, tmp_path / "a")
    with ctx as url:
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/metrics", headers=SUPPORT).status_code == 200
    ctx, state = _server(tiny_models, tmp_path / "b", metrics_public=True)
    with ctx as url:
        assert httpx.get(url + "/metrics").status_code == 200
        assert "security" not in httpx.get(url + "/openapi.json").json()["paths"]["/metrics"]["get"]


def test_kb_edits_rebuild_the_prefixes_requests_read(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two tenants read the support group; an edit rebuilds both tenants' prefixes (the editor's awaited,
    the other's queued behind it), never the untenanted one nobody reads, and unpins every tenant's
    obsolete blocks; the next keyed requests build nothing inside their TTFT."""
    ctx, state = _server(tiny_models, tmp_path)
    kb = state.kbs["demo"]
    ask = {"kb": "demo", "prompt": "Refund?", "max_tokens": 1}
    with ctx as url:
        for key in (SUPPORT, BETA):
            with client((url, state), key) as h:
                r = h.post("/v1/completions", json=ask).json()["kvfuse"]
                assert r["kb_build_s"] > 0  # the first read of each tenant's prefix builds it
        assert sorted(built_prefixes(kb), key=str) == [("support", "acme"), ("support", "beta")]
        cache = state.engine.cache
        before = {t: set(cache.block_hashes(kb.plan("support", t).ids, kb.plan("support", t).salts))
                  for t in ("acme", "beta")}
        assert all(b <= state.engine.store.tiers[0].pinned() for b in before.values())
        with client((url, state), LEADS) as h:  # an acme admin edits a support document (its first one)
            r = h.post("/v1/kb/demo/documents", json={"id": "plans", "text": "Team plan: 45 days to return."})
            assert r.status_code == 200, r.text
            out = r.json()
        assert [b["tenant"] for b in out["builds"]] == ["acme"] and out["rebuilds_queued"] == 1
        deadline = time.time() + 30
        while state.worker.depth and time.time() < deadline:  # the queued rebuild runs behind the edit
            time.sleep(0.05)
        assert ("support", None) not in built_prefixes(kb)  # nobody reads the untenanted prefix: never built
        pinned = set().union(*(t.pinned() for t in state.engine.store.tiers))
        for t in ("acme", "beta"):
            now = set(cache.block_hashes(kb.plan("support", t).ids, kb.plan("support", t).salts))
            assert now <= pinned and not (before[t] - now) & pinned, t  # obsolete blocks unpinned, every tenant
        for key in (SUPPORT, BETA):
            with client((url, state), key) as h:
                r = h.post("/v1/completions", json=ask).json()["kvfuse"]
                assert r["kb_build_s"] == 0 and r["cached_token_share"] > 0.5, r


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_errors_after_the_200_are_counted(srv, path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    state = srv[1]
    before = _metric(srv[0], "kvfuse_stream_errors_total").get(f"endpoint={path}", 0.0)

    def broken(*a, **k):  # type: ignore[no-untyped-def]
        raise RuntimeError("a step failed")

    monkeypatch.setattr(state.engine, "begin", broken)
    body = {"max_tokens": 2, "stream": True, **({"prompt": "hi"} if "chat" not in path else
                                                 {"messages": [{"role": "user", "content": "hi"}]})}
    with client(srv) as h:
        text = h.post(path, json=body).text
    assert "a step failed" in text and text.rstrip().endswith("data: [DONE]")
    assert _metric(srv[0], "kvfuse_stream_errors_total")[f"endpoint={path}"] == before + 1
