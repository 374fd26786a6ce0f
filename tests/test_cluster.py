"""Two replicas of `kvfuse serve` (a tiny model, a real Redis) behind the real SMG router on loopback:
the openai client through the router, kb questions routed to one replica, entries shared between
replicas, and a replica killed and restarted (slow: real processes)."""

from __future__ import annotations

import time

import httpx
import pytest
from kbdata import write_kb
from servable import servable_checkpoint
from serverutil import samples

from kvfuse.cluster import ROUTING_HEADER, cluster, routing_key

pytestmark = pytest.mark.slow
CHAT = "endpoint=/v1/chat/completions,status=200"


@pytest.fixture(scope="module")
def two(tiny_models, tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("cluster")
    model = servable_checkpoint(tiny_models["gemma3"][0], tmp / "model")
    write_kb(tmp / "kb")
    (tmp / "logs").mkdir()
    with cluster(2, ["--model", str(model), "--kb", str(tmp / "kb"), "--log-level", "warning"],
                 store_root=tmp / "stores", logs=tmp / "logs") as c:
        yield c, model.name


def _served(replica_url: str) -> float:
    text = httpx.get(replica_url + "/metrics", timeout=10).text
    return samples(text, "kvfuse_requests_total").get(CHAT, 0.0)


def _ask(c, model: str, question: str, key: str | None = None) -> httpx.Response:  # type: ignore[no-untyped-def]
    headers = {ROUTING_HEADER: key} if key else {}
    body = {"model": model, "messages": [{"role": "user", "content": question}], "kb": "demo", "max_tokens": 3,
            "temperature": 0}
    return httpx.post(c.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_the_openai_client_gets_answers_through_the_router(two) -> None:  # type: ignore[no-untyped-def]
    from openai import OpenAI

    c, model = two
    routed, direct = (OpenAI(base_url=u + "/v1", api_key="unused", max_retries=0)
                      for u in (c.url, c.replicas[0].url))
    msgs = [{"role": "user", "content": "Hello there, how long is the trial?"}]
    chats = [o.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0,  # type: ignore[arg-type]
                                       stop=["@@"]) for o in (routed, direct)]
    assert chats[0].choices[0].message.content == chats[1].choices[0].message.content  # the router is transparent
    assert chats[0].usage is not None and chats[0].usage.prompt_tokens > 0
    texts = [o.completions.create(model=model, prompt="Once upon a time", max_tokens=3, temperature=0, stop=["@@"])
             for o in (routed, direct)]
    assert texts[0].choices[0].text == texts[1].choices[0].text
    assert texts[0].usage is not None and texts[0].usage.completion_tokens == texts[1].usage.completion_tokens  # type: ignore[union-attr]
    assert [m.id for m in routed.models.list().data] == [model]


def test_a_kbs_questions_land_on_one_replica(two) -> None:  # type: ignore[no-untyped-def]
    c, model = two
    before = [_served(r.url) for r in c.replicas]
    answers = [_ask(c, model, f"Question {i}: what is the refund window?", routing_key("demo", "support"))
               for i in range(6)]
    assert all(a.status_code == 200 for a in answers)
    grew = [_served(r.url) - b for r, b in zip(c.replicas, before, strict=True)]
    assert sorted(grew) == [0.0, 6.0]  # all six on one replica
    cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert all(n > 0 for n in cached[1:])  # its prefix stayed in that replica's memory


def test_a_replica_reads_what_the_other_computed(two) -> None:  # type: ignore[no-untyped-def]
    c, model = two
    body = {"model": model, "prompt": "Question: what is the code?\nAnswer:", "max_tokens": 3, "temperature": 0,
            "documents": [{"text": "The door code is 4812, the safe is in room 7. " * 3}]}
    first = httpx.post(c.replicas[0].url + "/v1/completions", json=body, timeout=60).json()
    time.sleep(1.0)  # its write-back to Redis runs in the background
    second = httpx.post(c.replicas[1].url + "/v1/completions", json=body, timeout=60).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def _wait_workers(c, healthy: int, timeout_s: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(c.url + "/readiness", timeout=5).json().get("healthy_workers") == healthy:
            return
        time.sleep(0.2)
    raise AssertionError(f"the router never saw {healthy} healthy workers")


def test_a_killed_replica_is_routed_around_and_rejoins(two) -> None:  # type: ignore[no-untyped-def]
    c, model = two
    key = routing_key("demo", "support")
    assert _ask(c, model, "Which replica?", key).status_code == 200
    counts = [_served(r.url) for r in c.replicas]
    home = max(range(2), key=lambda i: counts[i])  # the replica this key lands on
    before = _served(c.replicas[home].url)
    assert _ask(c, model, "Which replica, again?", key).status_code == 200
    assert _served(c.replicas[home].url) == before + 1
    c.replicas[home].kill()
    _wait_workers(c, 1)  # the router noticed
    after = [_ask(c, model, f"Still there {i}?", key) for i in range(4)]
    assert [a.status_code for a in after] == [200] * 4  # the other replica answers, no 5xx
    c.replicas[home].start()
    _wait_workers(c, 2)
    back = _served(c.replicas[home].url)
    assert _ask(c, model, "And now?", key).status_code == 200
    assert _served(c.replicas[home].url) == back + 1  # the key's questions go home again
