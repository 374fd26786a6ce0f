"""Schemathesis against the served /openapi.json, with bounded examples: no request may cause a 500."""

import httpx
import pytest
import schemathesis
from chartok import CharTokenizer
from hypothesis import HealthCheck, settings
from kbdata import write_kb
from schemathesis.checks import not_a_server_error
from serverutil import serving

from kvfuse.engine import Engine
from kvfuse.kb.base import KnowledgeBase
from kvfuse.server.app import Limits, ServerState, create_app
from kvfuse.store import open_store
from kvfuse.weights import load_model


@pytest.fixture(scope="module")
def fuzz_url(tiny_models, tmp_path_factory):  # type: ignore[no-untyped-def]
    root, _ = tiny_models["llama"]
    lm = load_model(root)
    tmp = tmp_path_factory.mktemp("fuzz")
    write_kb(tmp / "kb")
    engine = Engine(lm.model, lm.fingerprint, store=open_store(tmp / "store", lm.fingerprint))
    kb = KnowledgeBase.open(tmp / "kb", engine, CharTokenizer(), state_dir=tmp / "store")
    state = ServerState(engine, CharTokenizer(), "tiny", {"demo": kb}, None, Limits(4, 200, 8))
    with serving(create_app(state)) as url:
        yield url


def test_no_request_causes_a_server_error(fuzz_url) -> None:  # type: ignore[no-untyped-def]
    """Every operation, bounded examples each (schemathesis' pytest plugin does not load on this pytest,
    so the operations' strategies are driven with Hypothesis directly)."""
    from hypothesis import given

    schema = schemathesis.openapi.from_url(fuzz_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    calls = []
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case) -> None:  # type: ignore[no-untyped-def]
            calls.append(case.call_and_validate(checks=[not_a_server_error]).status_code)
            assert httpx.get(fuzz_url + "/health").json()["status"] == "ok"  # healthy after every example

        check()
    assert len(calls) >= 5 * len(operations) and 500 not in calls
    assert any(c == 200 for c in calls) and any(400 <= c < 500 for c in calls)


def _text():  # type: ignore[no-untyped-def]
    from hypothesis import strategies as st

    # every code point, lone surrogates included (JSON carries them as \\ud800 escapes)
    return st.text(st.characters(exclude_categories=()), max_size=300)


def test_arbitrary_unicode_and_sizes_in_every_text_field(fuzz_url) -> None:  # type: ignore[no-untyped-def]
    """Every text field of every operation that takes text, with any code point and odd sizes: never a 500,
    and /health answers after each example."""
    import json

    import httpx
    from hypothesis import given
    from hypothesis import strategies as st

    t, n = _text(), st.one_of(st.none(), st.integers(-5, 10**6))
    message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                     "content": st.one_of(t, st.lists(st.fixed_dictionaries(
                                         {"type": st.just("text"), "text": t}), max_size=3))})
    common = {"max_tokens": n, "stop": st.one_of(st.none(), t, st.lists(t, max_size=5)),
              "documents": st.one_of(st.none(), st.lists(st.fixed_dictionaries({"text": t}), max_size=5)),
              "kb": st.one_of(st.none(), st.just("demo"), t), "user": st.one_of(st.none(), t),
              "logit_bias": st.one_of(st.none(), st.dictionaries(t, st.floats(-200, 200), max_size=3)),
              "kvfuse": st.one_of(st.none(), st.fixed_dictionaries({"group": st.one_of(st.none(), t)}))}
    ops = [("POST", "/v1/completions", st.fixed_dictionaries({"prompt": st.one_of(t, st.lists(t, max_size=2),
                                                                                   st.lists(st.integers(-3, 300),
                                                                                            max_size=20))},
                                                              optional=common)),
           ("POST", "/v1/chat/completions", st.fixed_dictionaries({"messages": st.lists(message, max_size=4)},
                                                                   optional=common)),
           ("POST", "/v1/kb/demo/documents", st.fixed_dictionaries({"id": t, "text": t},
                                                                    optional={"title": t, "groups": st.lists(t)})),
           ("DELETE", "/v1/kb/demo/documents/{}", t), ("GET", "/v1/kb/{}", t)]
    statuses: list[int] = []
    with httpx.Client(base_url=fuzz_url, timeout=60) as h:
        def checker(method: str, path: str, strategy):  # type: ignore[no-untyped-def]
            @given(value=strategy)
            @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def check(value) -> None:  # type: ignore[no-untyped-def]
                if isinstance(value, dict):
                    r = h.request(method, path, content=json.dumps(value),  # ensure_ascii: surrogates escaped
                                  headers={"Content-Type": "application/json"})
                else:
                    from urllib.parse import quote

                    r = h.request(method, path.format(quote(value.encode("utf-8", "surrogatepass"), safe="")))
                assert r.status_code < 500, (method, path, value, r.text)
                statuses.append(r.status_code)
                assert h.get("/health").json()["status"] == "ok"

            return check

        for method, path, strategy in ops:
            checker(method, path, strategy)()
    assert 200 in statuses and any(400 <= s < 500 for s in statuses)
