"""The Albarán knowledge base on the real default model: marked slow, and CI runs them."""

import json
import subprocess
import sys

import pytest

from kvfuse.cli import main

pytestmark = pytest.mark.slow
QUESTION = "How many days does a Team plan customer have to ask for a refund on an annual renewal?"


def _kb_docs():  # type: ignore[no-untyped-def]
    """What `conflicts_for` reads of the bundled knowledge base (its manifest and a tokenizer)."""
    from types import SimpleNamespace

    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.kb.manifest import load_manifest
    from kvfuse.runtime import bundled
    from kvfuse.text.tokenizer import Tokenizer

    return SimpleNamespace(manifest=load_manifest(bundled("albaran")), tok=Tokenizer(resolve_model_path(None)))


def _run(capsys, *argv: str) -> dict:  # type: ignore[no-untyped-def]
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_build_ask_and_reload_in_a_second_process(real_store, capsys) -> None:
    built = _run(capsys, "kb", "build", "albaran", "--store", str(real_store), "--quiet")
    assert set(built) >= {"tokens_total", "tokens_reused", "tokens_recomputed", "build_s", "bytes"}
    assert built["tokens_total"] > 8000 and built["bytes"] > 0
    a = _run(capsys, "ask", "--kb", "albaran", "--store", str(real_store), "--json", QUESTION)
    assert set(a) >= {"answer", "ttft_s", "tokens", "cached_token_share", "cost_units", "citations", "group",
                      "kb_version"}
    assert a["group"] == "support" and a["kb_version"] == built["kb_version"]
    assert a["tokens"]["cached"] == built["tokens_total"] and a["cached_token_share"] > 0.99  # blocks and tail
    assert set(a["cost_units"]) == {"write", "read", "uncached", "total"} and a["cost_units"]["write"] == 0
    assert a["finish_reason"] in ("stop", "length") and a["answer"]  # the answer is never cut to nothing
    from kvfuse.kb.conflicts import conflicts_for

    # the conflicts are exactly what the check finds for this answer (none when it states no quantity)
    assert [tuple(x.values()) for x in a["conflicts"]] == [
        tuple(c.as_dict().values()) for c in conflicts_for(_kb_docs(), "support", QUESTION, a["answer"])]
    if "14 days" in a["answer"]:  # the seed's failure: Team terms' 30 calendar days must be flagged
        assert any(x["doc_id"] == "team-terms" and "30 calendar days" in x["quote"] for x in a["conflicts"])
    for x in a["conflicts"]:
        assert set(x) == {"doc_id", "quote", "start", "end", "stated", "found", "found_text"}
        assert x["found_text"] in x["quote"]
    for c in a["citations"]:
        assert set(c) >= {"doc_id", "quote", "verified", "start", "end", "state", "supports"}
        assert isinstance(c["supports"], bool) and (c["doc_id"] is not None or not c["supports"])
        assert c["verified"] == (c["state"] == "verified")  # a passage found by search is never "verified"
        if c["verified"]:  # a verified quote is really in that document, at those offsets
            from kvfuse.kb.manifest import load_manifest

            text = load_manifest("albaran").document(c["doc_id"]).text
            assert " ".join(text[c["start"] : c["end"]].lower().split()) == " ".join(c["quote"].lower().split())
    out = subprocess.run([sys.executable, "-m", "kvfuse", "kb", "build", "albaran", "--store", str(real_store),
                          "--quiet"], capture_output=True, text=True, check=True).stdout
    again = json.loads(out.strip().splitlines()[-1])
    assert again["loaded"] and again["tokens_recomputed"] == 0 and again["tokens_reused"] == a["tokens"]["cached"]


def test_hybrid_ask_with_a_ticket_index(real_store, tmp_path, capsys) -> None:
    ix = _run(capsys, "index", "build", "albaran-tickets", "--out", str(tmp_path / "ix"))
    assert ix["documents"] == 16 and ix["chunks"] >= 16
    a = _run(capsys, "ask", "--kb", "albaran", "--store", str(real_store), "--index", str(tmp_path / "ix"),
             "--top-k", "1", "--json", "--no-quote", "Is the customer on ticket 4812 entitled to a refund?")
    assert a["mode"] == "queryaware" and a["fuser"] == "queryaware:weigh=mass"  # Gemma 3: its global layers' mass
    assert a["retrieved"] == ["ticket-4812"]
    assert a["tokens"]["cached"] > 8000 and a["recomputed_tokens"] > 0


def test_compare_on_two_questions(real_store, tmp_path, capsys) -> None:
    from importlib import resources

    qs = resources.files("kvfuse").joinpath("data/albaran/questions.json")
    res = _run(capsys, "compare", "--kb", "albaran", "--store", str(real_store), "--questions", str(qs),
               "--cases", "2", "--methods", "cag,rag-bm25@2,rag-hybrid@2", "--json", "--quiet",
               "--out", str(tmp_path / "cmp"))
    assert set(res["methods"]) == {"cag", "rag-bm25@2", "rag-hybrid@2"}
    for m in res["methods"].values():
        assert 0 <= m["accuracy"] <= 1 and m["ttft_s_median"] > 0 and m["cost_units_mean"] > 0
    rag = res["methods"]["rag-bm25@2"]
    assert rag["search_misses"] + rag["reading_misses"] == round((1 - rag["accuracy"]) * 2)
    assert res["methods"]["cag"]["cost_units_mean"] < 0.2 * res["builds"]["support"]["tokens_total"]
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 5000
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    states = {"verified", "not_found", "no_usable_quote", "retrieved"}
    for row in saved["per_question"]:
        for rec in row["methods"].values():  # every answer is cited, from what that method read
            assert rec["finish_reason"] in ("stop", "length")
            assert isinstance(rec["citations"], list) and all(c["state"] in states for c in rec["citations"]), rec
            retrieved = set(rec.get("retrieved", [])) or None
            for c in rec["citations"]:
                if c["state"] in ("verified", "retrieved") and retrieved:
                    assert c["doc_id"] in retrieved  # a RAG answer is cited from its own chunks
    for name, m in res["methods"].items():  # the summary counts what the per-question records hold
        recs = [row["methods"][name] for row in saved["per_question"]]
        assert m["citations"] == {st: sum(c["state"] == st for r in recs for c in r["citations"]) for st in states}
        assert m["empty_answers"] == sum(not r["answer"] for r in recs) and m["n"] == len(recs) == 2
        assert m["truncated"] == sum(r["finish_reason"] == "length" for r in recs)


def test_the_demo_prints_the_checks_and_how_to_open_the_page(real_store, capsys) -> None:
    from kvfuse.cli.main import main

    assert main(["demo", "--store", str(real_store)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert "kvfuse serve --kb albaran" in lines[-1] and "http://127.0.0.1:8000/" in lines[-1]
    located = [ln for ln in lines if "quote check: EXISTS in" in ln or "passage found by search" in ln]
    assert located  # each citation that points into a document says whether it supports the answer
    assert all("SUPPORTS the answer" in ln or "does NOT support the answer" in ln for ln in located)
    first = lines[next(i for i, ln in enumerate(lines) if ln.strip().startswith("answer:"))]
    if "14 days" in first:  # flagged, and the answer itself printed as disputed, the kb's value beside it
        assert any(ln.strip().startswith("CONFLICT: team-terms states 30 days, not 14 days") for ln in lines)
        assert "DISPUTED: '14 days." in first and any(
            "the knowledge base says 30 calendar days (team-terms), not 14 days" in ln for ln in lines)


def test_ask_answers_as_json_that_matches_a_schema(real_store, tmp_path, capsys) -> None:
    """Issue N.3 from the CLI: `ask --json-schema FILE` answers the kb question as JSON that the schema
    accepts (grammar-constrained, the server's response_format)."""
    schema = {"type": "object", "properties": {"days": {"type": "integer"}, "annual": {"type": "boolean"}},
              "required": ["days", "annual"], "additionalProperties": False}
    f = tmp_path / "refund.json"
    f.write_text(json.dumps(schema))
    a = _run(capsys, "ask", "--kb", "albaran", "--store", str(real_store), "--json", "--no-quote",
             "--json-schema", str(f), QUESTION)
    obj = json.loads(a["answer"])
    assert set(obj) == {"days", "annual"} and isinstance(obj["days"], int) and isinstance(obj["annual"], bool)
    assert a["finish_reason"] == "stop"
