"""Schemathesis against the served /openapi.json, with bounded examples: no request may cause a 500."""

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

        check()
    assert len(calls) >= 5 * len(operations) and 500 not in calls
    assert any(c == 200 for c in calls) and any(400 <= c < 500 for c in calls)
