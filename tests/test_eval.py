import json
import math

import pytest
import torch
from chartok import CharTokenizer

from kvfuse import fuse
from kvfuse.eval.data import DataError, load_cases
from kvfuse.eval.harness import EvalSettings, run_eval, summarize, write_outputs
from kvfuse.eval.methods import parse_methods
from kvfuse.eval.metrics import best_f1, contains_gold, fidelity, normalize_answer, rouge_l, token_f1
from kvfuse.rag.chunking import pack, token_windows


def test_longbench_normalisation_and_f1() -> None:
    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert token_f1("the Chynna Phillips", "Chynna Phillips") == 1.0
    # pred {chynna, phillips, singer}, gold {chynna, phillips}: p = 2/3, r = 1, F1 = 0.8
    assert token_f1("Chynna Phillips, singer", "Chynna Phillips") == pytest.approx(0.8)
    assert token_f1("", "x") == 0.0
    assert best_f1("Paris", ["London", "paris"]) == 1.0
    assert contains_gold("It is 30 days.", ["30 days"]) and not contains_gold("130 days", ["30 days"])


def test_rouge_l_known_value() -> None:
    # LCS of "the cat sat on the mat" / "the cat lay on the mat" is 5 of 6 tokens: P = R = F = 5/6
    assert rouge_l("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    assert rouge_l("", "anything") == 0.0


def test_fidelity_on_known_logits() -> None:
    ref = torch.tensor([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 5.0]])
    same = fidelity(ref, ref.clone(), [0, 1, 2])
    assert (same.first_token_agreement, same.token_agreement, same.kl) == (1.0, 1.0, 0.0)
    other = ref.clone()
    other[2] = torch.tensor([5.0, 0.0, 0.0])  # wrong on the last token only
    f = fidelity(ref, other, [0, 1, 2])
    assert f.first_token_agreement == 1.0 and f.token_agreement == pytest.approx(2 / 3)
    p, q = torch.softmax(ref[2], -1), torch.softmax(other[2], -1)
    assert f.kl == pytest.approx(float((p * (p / q).log()).sum()) / 3, rel=1e-5)
    with pytest.raises(ValueError):
        fidelity(ref[:1], ref, [0, 1])


def test_token_windows_and_packing() -> None:
    tok = CharTokenizer()
    spans = token_windows("abcdefghij", tok, 4, overlap=1)
    assert [(s.start, s.end) for s in spans] == [(0, 4), (3, 7), (6, 10)]
    assert pack(["aaa", "bbb", "cccccccccc", "dd"], tok, 7) == ["aaa\n\nbbb", "ccccccc", "ccc", "dd"]
    with pytest.raises(ValueError):
        token_windows("abc", tok, 4, overlap=4)


def test_retrieval_order_is_l2_nearest_first() -> None:
    import numpy as np

    from kvfuse.rag.dense import embed, top_k_l2

    q = "Which river flows through the city of Lyon?"
    texts = ["Bananas are rich in potassium.", "The Rhône flows through Lyon, a city in France.",
             "Lyon is a city.", "Stock markets fell on Monday."]
    got = top_k_l2(q, texts, 3)
    vecs = embed([q, *texts])
    dist = np.linalg.norm(vecs[1:] - vecs[0], axis=1)
    assert got == [int(i) for i in np.argsort(dist)[:3]]
    assert got[0] in (1, 2) and 0 not in got[:2] and 3 not in got[:2]


def test_method_specs() -> None:
    names = [m.name for m in parse_methods("full, blend@0.15,blend@auto,legolink@16,reuse,prefix,full")]
    assert names == ["full", "blend@0.15", "blend@auto", "legolink@16", "reuse", "prefix"]
    for bad in ("blend", "blend@2", "legolink@x", "nope", "full@1", ""):
        with pytest.raises(ValueError):
            parse_methods(bad)


def test_data_errors(tmp_path) -> None:
    p = tmp_path / "d.json"
    p.write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        load_cases(p)
    p.write_text(json.dumps([{"ctxs": [{"title": "t", "text": "x"}], "question": "q?"}]))
    with pytest.raises(DataError, match="lacks answers"):
        load_cases(p)
    p.write_text(json.dumps([{"ctxs": [{"title": "t", "text": "x"}], "question": "q?", "answers": ["a"]}] * 3))
    assert [c.index for c in load_cases(p, cases=1, offset=2)] == [2]
    with pytest.raises(DataError, match="past the end"):
        load_cases(p, offset=3)


def _cases(tmp_path):  # type: ignore[no-untyped-def]
    ctxs = [{"title": f"Place {i}", "text": f"Place {i} has {i} towers and a river. " * 3} for i in range(5)]
    raw = [{"ctxs": ctxs, "question": "How many towers has Place 3?", "answers": ["3"]},
           {"ctxs": ctxs[::-1], "question": "What does Place 1 have?", "answers": ["a river"]}]
    p = tmp_path / "cases.json"
    p.write_text(json.dumps(raw))
    return load_cases(p)


def test_harness_end_to_end_on_a_tiny_model(tiny_engines, tmp_path) -> None:
    engine = tiny_engines["gemma3"]
    methods = parse_methods("full,prefix,reuse,blend@0.3,blend@1.0,blend@0.15,legolink@4,queryaware@0.3,default,"
                            "mapreduce,maprerank,queryaware@0.2,queryaware@0.2:behind=bos,reuse:behind=self")
    res = run_eval(engine, CharTokenizer(), _cases(tmp_path), methods, EvalSettings(top_k=3, chunk_tokens=60,
                   max_tokens=6), "tiny", "cases.json", progress=False)
    assert set(res) >= {"model", "data", "cases", "top_k", "methods", "per_case"}
    assert list(res["methods"]) == [m.name for m in methods]
    for name, m in res["methods"].items():
        assert m["n"] == 2, name
        for key in ("f1", "rouge_l", "first_token_agreement", "token_agreement", "kl", "answer_agreement_f1",
                    "ttft_s_median", "ttft_s_mean", "recomputed_fraction"):
            assert math.isfinite(m[key]), (name, key)
    full, exact = res["methods"]["full"], res["methods"]["blend@1.0"]
    assert (full["token_agreement"], full["kl"]) == (1.0, 0.0)
    assert exact["token_agreement"] == 1.0 and exact["kl"] < 1e-6  # blend at 1.0 is full
    assert res["methods"]["prefix"]["kl"] < 1e-6  # prefix caching is exact too
    assert res["methods"]["reuse"]["recomputed_fraction"] == 0.0
    assert 0.0 < res["methods"]["blend@0.3"]["recomputed_fraction"] < 1.0
    for case in res["per_case"]:
        assert len(case["chunk_tokens"]) == 3 and max(case["chunk_tokens"]) <= 62
    paths = write_outputs(res, tmp_path / "out")
    names = {p.name for p in paths}
    assert names == {"results.json", "report.md", "quality_vs_ttft.png", "ratio_sensitivity.png",
                     "fidelity_vs_ttft.png"}
    default, plain = res["methods"]["default"], res["methods"]["queryaware@0.2"]  # no calibration: the default ratio
    assert (default["kl"], default["recomputed_fraction"]) == (plain["kl"], plain["recomputed_fraction"])
    assert res["methods"]["queryaware@0.2:behind=bos"]["kl"] != plain["kl"]  # another preamble, another cache
    assert res["methods"]["reuse:behind=self"]["kl"] != res["methods"]["reuse"]["kl"]
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert json.loads((tmp_path / "out" / "results.json").read_text())["cases"] == 2
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| blend@0.3 |" in report and "| legolink@4 |" in report and "| **default** (recommended) |" in report
    settled = fuse.spec_of(engine.fuser(fuse.DEFAULT_MODE))  # the default with its options settled for the model
    assert settled.startswith("queryaware") and f"default mode `{settled}` at ratio 0.2 " in report


def test_summary_medians_and_errors() -> None:
    def rec(t: float, f1: float) -> dict:
        return {"f1": f1, "rouge_l": 0.0, "first_token_agreement": 1.0, "token_agreement": 1.0, "kl": 0.0,
                "answer_agreement_f1": 1.0, "ttft_s": t, "recomputed_fraction": 0.5, "computed_fraction": 0.5}

    per_case = [{"methods": {"full": rec(4.0, 1.0), "blend@0.15": rec(1.0, 0.0)}},
                {"methods": {"full": rec(2.0, 0.0), "blend@0.15": rec(1.0, 1.0)}},
                {"methods": {"full": rec(6.0, 1.0), "blend@0.15": {"error": "too long"}}}]
    s = summarize(per_case, ["full", "blend@0.15"])
    assert s["full"]["ttft_s_median"] == 4.0 and s["full"]["f1"] == pytest.approx(2 / 3)
    assert s["blend@0.15"]["n"] == 2 and s["blend@0.15"]["errors"] == 1
    assert s["blend@0.15"]["ttft_ratio_to_full_median"] == pytest.approx((0.25 + 0.5) / 2)


def test_crosschunk_cases_need_two_passages() -> None:
    from kvfuse.eval.crosschunk import MAX_TOKENS, MIN_TOKENS, make_cases

    count = lambda t: len(t.split())  # noqa: E731  (any token counter; the CLI passes the model's)
    cases = make_cases(12, seed=3, count=count)
    assert make_cases(12, seed=3, count=count) == cases  # reproducible
    assert {c["kind_of_question"] for c in cases} == {"compare", "bridge", "control"}
    for c in cases:
        assert all(MIN_TOKENS <= count(p["text"]) <= MAX_TOKENS for p in c["ctxs"])
        gold = [c["ctxs"][i]["text"] for i in c["gold_passages"]]
        if c["kind_of_question"] == "control":
            assert len(gold) == 1 and c["answers"][0] in gold[0]
        else:
            assert len(gold) == 2  # the answer needs both passages
        if c["kind_of_question"] == "bridge":
            assert c["answers"][0] in gold[1] or c["answers"][0] in gold[0]
            assert sum(c["answers"][0] in t for t in gold) == 1  # the province is in one, the person in the other
        if c["kind_of_question"] == "compare":
            import re

            wins = [int(re.search(r"won the national cup (\d+) times", t).group(1)) for t in gold]
            clubs = [re.search(r"The ([A-Z]\w+ [A-Z]\w+) have won", t).group(1) for t in gold]
            assert c["answers"][0] == clubs[wins.index(max(wins))]


def test_attention_weights_reproduce_attend(tiny_engines) -> None:
    m = tiny_engines["gemma3"].model
    ids = torch.arange(3, 40)
    pos = torch.arange(37)
    with torch.inference_mode():
        h = m.embed(ids)
        for i in range(2):  # a sliding and a global layer in the tiny config
            q, k, v = m.project(i, h, pos)
            w = m.attention_weights(i, q[:, -5:], pos[-5:], k, pos)
            assert torch.allclose(w.sum(-1), torch.ones(w.shape[:2]), atol=1e-5)
            groups = q.shape[0] // k.shape[0]
            out = (w @ v.repeat_interleave(groups, 0).float()).transpose(0, 1).reshape(5, -1)
            assert torch.allclose(out, m.attend(i, q[:, -5:], pos[-5:], k, v, pos).float(), atol=1e-5)


def test_deviation_run_on_a_tiny_model(tiny_engines, tmp_path) -> None:
    from kvfuse.eval.deviation import run_deviation

    res = run_deviation(tiny_engines["llama"], CharTokenizer(), _cases(tmp_path), [0.2, 1.0], 3, 60,
                        tmp_path / "dev", progress=False)
    dev = res["attention_deviation"]
    assert dev["reuse"] > 1e-4  # reuse misses the cross-attention
    assert dev["hkvd"]["1.0"] < 1e-5 and dev["random"]["1.0"] < 1e-5  # recomputing everything is exact
    for r in ("0.2", "1.0"):
        assert all(0.0 <= x <= 1.0 for x in res["hkvd_overlap"][r]["per_layer"])
    assert res["hkvd_overlap"]["1.0"]["mean"] == 1.0
    for f in ("attention_deviation.png", "hkvd_overlap.png", "deviation.json"):
        assert (tmp_path / "dev" / f).stat().st_size > 0
