"""The eval harness on the real default model: marked slow, and CI runs them."""

import json

import pytest
from conftest import MUSIQUE

from kvfuse.cli import main

pytestmark = pytest.mark.slow


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
    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.text import Tokenizer

    out = tmp_path / "cc.json"
    assert main(["eval", "make-crosschunk", "--n", "4", "--seed", "5", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())
    tok = Tokenizer(resolve_model_path(None))
    sizes = [len(tok.encode(p["text"])) for c in cases for p in c["ctxs"]]
    assert len(cases) == 4 and min(sizes) >= 300 and max(sizes) <= 500


def test_eval_default_reads_the_models_calibration_on_a_machine_without_a_profile(tmp_path, monkeypatch,
                                                                                 capsys) -> None:
    """After `kvfuse calibrate`, `eval --methods default` runs the default fuser at its calibrated floor
    (ratio auto) and each case says what the calibration predicted, even where no controller profile
    was measured yet (the eval measures one)."""
    import os

    from kvfuse import fuse
    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.policy import Calibration, CurvePoint
    from kvfuse.profile import save_calibration
    from kvfuse.weights import load_model

    path = resolve_model_path(None)
    (tmp_path / "cache").mkdir()
    os.symlink(path.parent, tmp_path / "cache" / "models")  # the converted model, in a fresh cache dir
    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path / "cache"))
    key = fuse.fuser_key(fuse.for_model(fuse.get_fuser(fuse.DEFAULT_MODE), load_model(path).model.cfg))
    curve = (CurvePoint(0.2, 0.05, 0.8, 0.3), CurvePoint(0.5, 0.01, 1.0, 0.6))  # floor 0.5 at target 0.02
    save_calibration(Calibration(load_model(path).fingerprint, 0.02, {key: curve}, 1, 1), tmp_path / "cache")
    out = tmp_path / "eval"
    assert main(["eval", "--data", str(MUSIQUE), "--cases", "1", "--methods", "default", "--max-tokens", "4",
                 "--out", str(out), "--quiet"]) == 0
    case = json.loads((out / "results.json").read_text())["per_case"][0]["methods"]["default"]
    assert case["ratio"] == 0.5 and case["predicted_kl"] == pytest.approx(0.01) and case["meets_target"] is True
    assert case["predicted_kl_bound"] == pytest.approx(0.01)  # no spread given: the bound is the mean
    assert 0.45 < case["recomputed_fraction"] < 0.55


def test_calibrate_cli_keeps_other_fusers_curves(tmp_path, monkeypatch, capsys) -> None:
    """`kvfuse calibrate` stores curves under the model's fingerprint; calibrating one more fuser on the
    same set and target keeps the curves measured before (a new set replaces them all)."""
    import os

    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.profile import load_calibration
    from kvfuse.weights import load_model

    path = resolve_model_path(None)
    (tmp_path / "cache").mkdir()
    os.symlink(path.parent, tmp_path / "cache" / "models")
    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path / "cache"))
    base = ["calibrate", "--cases", "1", "--ratios", "0.5,1.0", "--answer-tokens", "4", "--quiet"]
    assert main([*base, "--fusers", "blend"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["kept"] == [] and list(first["floors"]) == [k for k in first["curves"]] and len(first["curves"]) == 1
    assert main([*base, "--fusers", "queryaware"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["kept"] == list(first["curves"])
    cal = load_calibration(tmp_path / "cache", load_model(path).fingerprint)
    assert cal is not None and set(cal.curves) == set(first["curves"]) | set(second["curves"])
    for curve in cal.curves.values():
        assert [p.ratio for p in curve] == [0.5, 1.0] and curve[-1].kl < 1e-3  # at 1.0 every fuser is full
    assert main([*base, "--fusers", "queryaware", "--seed", "7"]) == 0  # another set: only its own curves
    assert json.loads(capsys.readouterr().out)["kept"] == []
