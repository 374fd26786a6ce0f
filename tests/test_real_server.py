"""`kvfuse serve` as a process, with the real default model and the Albarán knowledge base (slow)."""

import json
from pathlib import Path

import httpx
import pytest
from conftest import MUSIQUE

from kvfuse.server.process import serve_process

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(real_store, tmp_path_factory):  # type: ignore[no-untyped-def]
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text('[[keys]]\nkey = "sk-test-support"\ntenant = "acme"\n[keys.kb]\nalbaran = ["support"]\n'
                    '[[keys]]\nkey = "sk-test-admin"\ntenant = "acme"\nadmin = true\n'
                    '[keys.kb]\nalbaran = ["support"]\n')
    with serve_process(["--kb", "albaran", "--store", str(real_store), "--keys", str(keys), "--log-level", "warning"]) \
            as url:
        yield url


def test_openai_client_against_the_real_server(server) -> None:
    import openai

    oc = openai.OpenAI(base_url=server + "/v1", api_key="sk-test-support")
    q = "How many days does a Team plan customer have to ask for a refund on an annual renewal?"
    cold = oc.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": "Hello"}],
                                      max_tokens=2, temperature=0, extra_body={"kb": "albaran"})
    # tenant acme's private documents are salted: its first request builds them, and says so
    assert cold.model_extra["kvfuse"]["kb_build_s"] > 0
    r = oc.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": q}], max_tokens=12,
                                   temperature=0, extra_body={"kb": "albaran"})
    assert r.choices[0].message.content and r.usage.prompt_tokens_details.cached_tokens > 8000
    extra = r.model_extra["kvfuse"]
    assert extra["group"] == "support" and extra["cached_token_share"] > 0.95 and "citations" in extra
    parts = list(oc.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": q}],
                                            max_tokens=12, temperature=0, stream=True,
                                            extra_body={"kb": "albaran"}))
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == r.choices[0].message.content


def test_second_identical_request_with_documents_is_cached_and_faster(server) -> None:
    case = json.loads(MUSIQUE.read_text())[7]
    body = {"model": "gemma3-270m", "prompt": f"Question: {case['question']}\nAnswer:", "max_tokens": 4,
            "temperature": 0, "documents": [{"text": c["text"]} for c in case["ctxs"][:4]]}
    with httpx.Client(base_url=server, headers={"Authorization": "Bearer sk-test-support"}, timeout=300) as h:
        first = h.post("/v1/completions", json=body).json()
        second = h.post("/v1/completions", json=body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 1000
    assert second["kvfuse"]["ttft_s"] < first["kvfuse"]["ttft_s"]
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_the_page_on_the_real_model_flags_the_demo_conflict(server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The demo question in a real browser: a streamed answer, its citations, and, when the model answers
    the FAQ's 14 days, the conflict with Team terms' 30 calendar days, opened in the document. Its
    screenshots go to a temporary folder, or to $KVFUSE_SCREENSHOTS where that is set: the README's come
    from `KVFUSE_SCREENSHOTS=docs/screenshots` (a test run does not rewrite files in the repository)."""
    import os

    from playwright.sync_api import sync_playwright

    shots = Path(os.environ.get("KVFUSE_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    q = "How many days does a Team plan customer have to ask for a refund on an annual renewal?"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(server + "/")
        page.fill("#key", "sk-test-admin")
        page.click("#signin-form button")
        page.wait_for_selector("#app:not([hidden])")
        page.fill("#question", q)
        page.click("#ask")
        page.wait_for_selector(".turn .meta:has-text('TTFT')", timeout=300_000)
        answer = page.inner_text(".turn .answer")
        assert answer.strip() and float(page.get_attribute(".turn", "data-first-char-ms") or "nan") > 0
        assert page.locator(".turn .cite").count() >= 1
        page.fill("#question", "And on a monthly plan?")  # a follow-up: the first turn is read from the cache
        page.click("#ask")
        page.wait_for_function("document.querySelectorAll('.turn .meta').length == 2 && document.querySelectorAll("
                               "'.turn')[1].querySelector('.meta').textContent.includes('TTFT')", timeout=300_000)
        follow_up = page.locator(".turn").nth(1).locator(".meta").inner_text()
        assert float(follow_up.split("cached ")[1].split("%")[0]) > 90
        page.screenshot(path=str(shots / "ask.png"), full_page=True)
        if "14 days" in answer:  # the seed's failure: it must be flagged, and the answer look disputed
            first = page.locator(".turn").first
            assert "disputed" in (first.locator(".answer").get_attribute("class") or "")
            assert "The knowledge base says 30 calendar days (team-terms)" in first.locator(".dispute").inner_text()
            conflict = first.locator(".conflict")
            assert conflict.count() >= 1 and "team-terms" in conflict.first.inner_text()
            assert "30 calendar days" in conflict.first.inner_text()
            conflict.first.locator("a").click()
            page.wait_for_selector("#viewer:not([hidden]) mark.other")
            assert "30 calendar days" in page.inner_text("#viewer mark")
            page.screenshot(path=str(shots / "conflict.png"))
            page.click("#viewer-close")
        page.click(".tab[data-tab=docs]")
        page.wait_for_selector("#doc-list tr.doc")
        page.click("#doc-list tr.doc[data-id=team-terms]")
        page.wait_for_selector("#doc-form:not([hidden])")
        page.screenshot(path=str(shots / "documents.png"))
        page.click(".tab[data-tab=usage]")
        page.wait_for_selector(".group-usage svg circle")
        page.screenshot(path=str(shots / "usage.png"))
        browser.close()
    assert all((shots / name).stat().st_size > 0 for name in ("ask.png", "documents.png", "usage.png"))


def test_logprobs_on_the_real_model(server) -> None:
    """Issue N.3 on Gemma 3 (SentencePiece tokens): a kb question's token texts make up its answer, with
    their leading spaces, and a greedy token is its own most likely alternative."""
    import openai

    oc = openai.OpenAI(base_url=server + "/v1", api_key="sk-test-support")
    q = "How many days does a Team plan customer have to ask for a refund on an annual renewal?"
    r = oc.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": q}], max_tokens=12,
                                   temperature=0, logprobs=True, top_logprobs=5, extra_body={"kb": "albaran"})
    content = r.choices[0].logprobs.content
    assert len(content) >= 1 and "".join(c.token for c in content).strip() == r.choices[0].message.content.strip()
    assert all(c.top_logprobs[0].token == c.token and len(c.top_logprobs) == 5 for c in content)


def test_structured_answers_through_the_openai_client(server) -> None:
    """Issue N.3 on the default model: `chat.completions.parse` with a Pydantic model returns a valid
    object, on a kb question and on a plain one; a json_object answer parses, streamed too; an answer cut
    by max_tokens mid-object says finish_reason "length"; logprobs name only tokens the grammar allows."""
    import json

    import openai
    from pydantic import BaseModel, Field

    class Refund(BaseModel):
        days: int = Field(ge=0, le=365)
        annual: bool

    oc = openai.OpenAI(base_url=server + "/v1", api_key="sk-test-support")
    q = "How many days does a Team plan customer have to ask for a refund on an annual renewal?"
    kb = oc.chat.completions.parse(model="gemma3-270m", messages=[{"role": "user", "content": q}], max_tokens=40,
                                   temperature=0, response_format=Refund, extra_body={"kb": "albaran"})
    assert kb.choices[0].finish_reason == "stop" and isinstance(kb.choices[0].message.parsed, Refund)
    plain = oc.chat.completions.parse(model="gemma3-270m", max_tokens=40, temperature=0.3, seed=2,
                                      messages=[{"role": "user", "content": "Give a refund window as JSON."}],
                                      response_format=Refund, logprobs=True, top_logprobs=3)
    assert isinstance(plain.choices[0].message.parsed, Refund)
    assert "".join(c.token for c in plain.choices[0].logprobs.content) == plain.choices[0].message.content
    strict = {**Refund.model_json_schema(), "additionalProperties": False}  # as `parse` sends it
    schema = {"type": "json_schema", "json_schema": {"name": "Refund", "schema": strict}}
    streamed = oc.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": q}],
                                          max_tokens=40, temperature=0, response_format=schema, stream=True,
                                          extra_body={"kb": "albaran"})
    parts = list(streamed)
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    finish = [p.choices[0].finish_reason for p in parts if p.choices and p.choices[0].finish_reason]
    assert Refund.model_validate_json(text) == kb.choices[0].message.parsed and finish == ["stop"]
    cut = oc.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": q}], max_tokens=3,
                                     temperature=0, response_format=schema)  # `{"days":` alone takes more
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.startswith('{"')
    try:
        json.loads(cut.choices[0].message.content)
        raise AssertionError("three tokens closed the object")  # the cut is mid-object
    except json.JSONDecodeError:
        pass
    anything = oc.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": q}],
                                          max_tokens=60, temperature=0, response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":  # any object, closed by the grammar
        assert isinstance(json.loads(anything.choices[0].message.content), dict)


def _server_pid(url: str) -> int:
    port = url.rsplit(":", 1)[1].encode()
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if d.name.isdigit() and b"serve" in cmd and port in cmd:
            return int(d.name)
    raise LookupError(f"no kvfuse serve process on port {port.decode()}")


def _sleeps(pid: int) -> int:
    """Voluntary context switches of all the process's threads so far (a thread that waits, sleeps)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended
            continue
        total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_a_served_prefill_runs_on_one_openmp_team_that_does_not_sleep_between_products(server) -> None:
    """The server's torch work runs on its model thread's OpenMP team alone: its model was loaded on a
    thread that ended (`worker.on_passing_thread`). With a second team (the model loaded on the main
    thread), GNU OpenMP's idle threads outnumber a 2-core machine's cores and sleep after every parallel
    region: a 6-passage RAG request then cost the process about 10,000 voluntary context switches
    (and a quarter of its time), against about 50 with one team."""
    case = json.loads(MUSIQUE.read_text())[0]
    body = {"model": "gemma3-270m", "prompt": f"Question: {case['question']}\nAnswer:", "max_tokens": 8,
            "temperature": 0, "documents": [{"text": c["text"]} for c in case["ctxs"][:6]]}
    q = {"model": "gemma3-270m", "messages": [{"role": "user", "content": "How do I get a refund?"}],
         "max_tokens": 4, "temperature": 0, "kb": "albaran"}
    pid = _server_pid(server)
    with httpx.Client(base_url=server, headers={"Authorization": "Bearer sk-test-support"}, timeout=300) as h:
        h.post("/v1/chat/completions", json=q).raise_for_status()  # planning a kb question ran first
        h.post("/v1/completions", json=body).raise_for_status()  # the chunk caches, computed once
        before = _sleeps(pid)
        r = h.post("/v1/completions", json=body)
        after = _sleeps(pid)
    r.raise_for_status()
    assert r.json()["usage"]["prompt_tokens"] > 3000
    assert after - before < 1500, f"{after - before} voluntary context switches for one request"
