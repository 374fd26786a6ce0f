"""The eval harness on the real default model: marked slow, and CI runs them."""

import json

import pytest
from conftest import SHARED

from kvfuse.cli import main

pytestmark = pytest.mark.slow
MUSIQUE = SHARED / "data" / "musique_dev.json"


def test_eval_cli_end_to_end_on_two_cases(tmp_path, capsys) -> None:
    out = tmp_path / "eval"
    assert main(["eval", "--data", str(MUSIQUE), "--cases", "2", "--offset", "3", "--methods",
                 "full,reuse,blend@0.15,blend@1.0,legolink@16", "--max-tokens", "8", "--out", str(out),
                 "--quiet"]) == 0
    printed = json.loads(capsys.readouterr().out)
    res = json.loads((out / "results.json").read_text())
    assert res["cases"] == 2 and res["top_k"] == 6 and len(res["per_case"]) == 2
    assert [c["index"] for c in res["per_case"]] == [3, 4]
    assert set(printed["files"]) == {"results.json", "report.md", "quality_vs_ttft.png", "ratio_sensitivity.png",
                                     "fidelity_vs_ttft.png"}
    m = res["methods"]
    assert m["blend@1.0"]["token_agreement"] == 1.0 and m["blend@1.0"]["kl"] < 1e-3
    assert m["blend@0.15"]["kl"] <= m["reuse"]["kl"] * 1.5  # never far worse than plain reuse
    assert 0.15 < m["blend@0.15"]["recomputed_fraction"] < 0.3 and m["reuse"]["recomputed_fraction"] == 0
    assert all(c["methods"]["blend@0.15"]["ttft_s"] > 0 for c in res["per_case"])  # speed: docs/benchmarks.md
    for case in res["per_case"]:
        assert len(case["chunk_tokens"]) == 6 and max(case["chunk_tokens"]) <= 520


def test_make_crosschunk_sizes_passages_in_model_tokens(tmp_path, capsys) -> None:
    from kvfuse.text import Tokenizer
    from kvfuse.weights import resolve_model_path

    out = tmp_path / "cc.json"
    assert main(["eval", "make-crosschunk", "--n", "4", "--seed", "5", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())
    tok = Tokenizer(resolve_model_path(None))
    sizes = [len(tok.encode(p["text"])) for c in cases for p in c["ctxs"]]
    assert len(cases) == 4 and min(sizes) >= 300 and max(sizes) <= 500
