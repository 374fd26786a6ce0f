"""The `supports` rule on hand-labelled examples from the Albarán documents (tests/data/supports.json),
through the same path an answer's citations take: the quote is found in its document, then judged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfuse.kb.facts import Quantity, quantities, supports
from kvfuse.kb.manifest import load_manifest
from kvfuse.kb.quotes import find_quote, judge

EXAMPLES = json.loads((Path(__file__).parent / "data" / "supports.json").read_text())


@pytest.fixture(scope="module")
def docs():  # type: ignore[no-untyped-def]
    from kvfuse.runtime import bundled

    return load_manifest(bundled("albaran")).documents


def test_there_are_enough_labelled_examples_of_both_kinds() -> None:
    assert len(EXAMPLES) >= 30
    assert sum(e["supports"] for e in EXAMPLES) >= 10 and sum(not e["supports"] for e in EXAMPLES) >= 10


@pytest.mark.parametrize("ex", EXAMPLES, ids=[f"{i}-{e['answer'][:20]}" for i, e in enumerate(EXAMPLES)])
def test_the_rule_agrees_with_the_label(docs, ex) -> None:  # type: ignore[no-untyped-def]
    cited = find_quote(ex["quote"], [d for d in docs if d.id == ex["doc"]])
    assert cited.verified, f"the example's quote is not in {ex['doc']}: fix the test data"
    assert judge(cited, ex["answer"], docs).supports is ex["supports"], ex["why"]


def test_quantities_read_numbers_with_their_units() -> None:
    got = [(q.value, q.unit) for q in quantities("€29 a month, 30 calendar days, a 15-day trial, 20% off, "
                                                  "1,000 invoices, sixty days, 12 euros, 200 GB, 5 to 7 business days")]
    assert got == [(29, "euros"), (30, "days"), (15, "days"), (20, "percent"), (1000, "invoices"), (60, "days"),
                   (12, "euros"), (200, "GB"), (7, "days")]
    assert quantities("Section 7 of the terms, version 2.1") == []
    assert str(Quantity(14.0, "days", 0, 7)) == "14 days"


def test_nothing_checkable_is_never_supported() -> None:
    assert not supports("Yes.", "Yes, you can.") and not supports("", "anything")
