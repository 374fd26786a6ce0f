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


def test_a_statement_about_another_period_or_plan_is_not_a_conflict(docs) -> None:  # type: ignore[no-untyped-def]
    """Issue Q.3: the question's qualifiers (billing period, plan) leave out sentences whose paragraph and
    title name only other cases; a statement of the question's own case still conflicts."""
    from kvfuse.kb.conflicts import Qualifiers

    monthly = "How many days does a customer on a monthly Team plan have to get a refund?"
    assert all("annual" not in c.quote.lower() and "30 days have passed" not in c.quote
               for c in find_conflicts(docs, CharTokenizer(), monthly, "14 days."))
    assert find_conflicts(docs, CharTokenizer(), REFUND, "14 days.")[0].found_text == "30 calendar days"
    q = Qualifiers.of(docs)
    asked = q.named("What does the Business plan cost on monthly billing?")
    assert asked == [{"monthly"}, {"business"}]
    assert q.elsewhere(asked, "Team plan terms. The plan costs €29 per month billed monthly.")  # another plan
    assert q.elsewhere(asked, "Billing. Annual subscriptions are charged in advance.")  # another period
    assert not q.elsewhere(asked, "Billing. Monthly and annual subscriptions renew.")  # names the question's too
    assert not q.elsewhere(asked, "FAQ. Refunds reach your card within 10 business days.")  # names none
    assert not q.elsewhere(q.named("How many business days until a refund?"), "Team plan terms. Refunds.")


def test_ask_prints_a_disputed_answer_as_disputed(docs) -> None:  # type: ignore[no-untyped-def]
    """Issue Q.3 in the terminal: `kvfuse ask` marks the answer and names the knowledge base's value."""
    from kvfuse.kb.conflicts import answer_lines

    found = find_conflicts(docs, CharTokenizer(), REFUND, "14 days.")
    out = answer_lines("14 days.", found)
    assert out.splitlines() == ["DISPUTED: 14 days.", "  the knowledge base says 30 calendar days (team-terms), "
                                                      "not 14 days"]
    assert answer_lines("30 days.", []) == "30 days."
    assert answer_lines("14 days.", found, color=True).startswith("\033[1;33mDISPUTED: 14 days.\033[0m")


def test_kept_indexes_on_disk_are_pruned_to_the_ones_used_last(docs, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every edit of a knowledge base's texts keeps a new index on disk: beyond INDEXES_KEPT, the ones used
    longest ago are deleted, and reading one marks it used."""
    from kvfuse.kb import conflicts

    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(conflicts, "INDEXES_KEPT", 2)

    class Named(CharTokenizer):
        fingerprint = "vocab-a"

    def kept() -> set[str]:
        return {d.name for d in (tmp_path / "indexes").iterdir() if not d.name.startswith(".")}

    conflicts._INDEXES.clear()
    conflicts.kb_index(docs[:1], Named())
    (a,) = kept()
    conflicts.kb_index(docs[:2], Named())
    (b,) = kept() - {a}
    conflicts._INDEXES.clear()  # a new process reads the first one again: it is used last now
    conflicts.kb_index(docs[:1], Named())
    assert kept() == {a, b}
    conflicts.kb_index(docs[:3], Named())  # a third version: the one used longest ago goes
    (c,) = kept() - {a}
    assert kept() == {a, c}
    conflicts._INDEXES.clear()
    again = conflicts.kb_index(docs[:2], Named())  # the pruned one is built again, whole
    conflicts._INDEXES.clear()
    assert conflicts.kb_index(docs[:2], Named()).search(REFUND, 3) == again.search(REFUND, 3)
    assert kept() == {b, c}


def test_the_index_is_kept_on_disk_per_vocabulary_and_built_once(docs, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A process of its own (`kvfuse ask`) reads the conflict index another one built, where the tokenizer
    names its vocabulary; another vocabulary cuts other passages, so it gets its own."""
    import numpy as np

    from kvfuse.kb import conflicts
    from kvfuse.rag.index import Index

    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path))
    builds: list[int] = []
    real = Index.build
    monkeypatch.setattr(Index, "build", classmethod(lambda cls, *a, **k: builds.append(1) or real(*a, **k)))

    class Named(CharTokenizer):
        fingerprint = "vocab-a"

    first = conflicts.kb_index(docs[:3], Named())
    conflicts._INDEXES.clear()  # as a new process finds it
    again = conflicts.kb_index(docs[:3], Named())
    assert len(builds) == 1 and again is not first
    assert [c.text for c in again.chunks] == [c.text for c in first.chunks]
    assert np.array_equal(again.dense, first.dense)
    assert again.search(REFUND, 3) == first.search(REFUND, 3)
    conflicts._INDEXES.clear()
    Named.fingerprint = "vocab-b"
    conflicts.kb_index(docs[:3], Named())
    assert len(builds) == 2 and len(list((tmp_path / "indexes").iterdir())) == 2
    conflicts._INDEXES.clear()
    conflicts.kb_index(docs[:3], CharTokenizer())  # a vocabulary without a name: memory only
    assert len(builds) == 3 and len(list((tmp_path / "indexes").iterdir())) == 2
