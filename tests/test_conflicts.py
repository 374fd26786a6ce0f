"""Conflicts on the Albarán documents: an answer's quantity against the passages relevant to the question."""

from __future__ import annotations

import pytest
from chartok import CharTokenizer

from kvfuse.kb.conflicts import find_conflicts
from kvfuse.kb.manifest import load_manifest
from kvfuse.runtime import bundled

REFUND = "How many days does a Team plan customer have to ask for a refund on an annual renewal?"


@pytest.fixture(scope="module")
def docs():  # type: ignore[no-untyped-def]
    return load_manifest(bundled("albaran")).readable("support")


def test_the_demo_answer_is_flagged_by_team_terms(docs) -> None:  # type: ignore[no-untyped-def]
    found = find_conflicts(docs, CharTokenizer(), REFUND, "14 days.")
    assert [(c.doc_id, c.stated, c.found) for c in found] == [("team-terms", "14 days", "30 days")]
    team = next(d for d in docs if d.id == "team-terms")
    c = found[0]
    assert team.text[c.start : c.end] == c.quote and "30 calendar days" in c.quote


def test_no_quantity_no_conflict_and_agreeing_passages_are_not_flagged(docs) -> None:  # type: ignore[no-untyped-def]
    assert find_conflicts(docs, CharTokenizer(), REFUND, "You can ask the billing team.") == []
    for c in find_conflicts(docs, CharTokenizer(), REFUND, "30 days."):
        assert c.found != "30 days" and "30 calendar days" not in c.quote


def test_units_must_match(docs) -> None:  # type: ignore[no-untyped-def]
    found = find_conflicts(docs, CharTokenizer(), "How much does the Team plan cost per month?", "€35 per month.")
    assert found and all(c.found.endswith("euros") and c.stated == "35 euros" for c in found)


def test_a_right_answer_stated_by_the_closest_passage_is_not_flagged(docs) -> None:  # type: ignore[no-untyped-def]
    q = "How long does a Team workspace stay read-only after its subscription ends?"
    assert find_conflicts(docs, CharTokenizer(), q, "60 days.") == []  # "read-only for 60 days" is closest
    wrong = find_conflicts(docs, CharTokenizer(), q, "90 days.")
    assert wrong and wrong[0].doc_id == "team-terms" and wrong[0].found == "60 days"
