"""Any GGUF of a supported family runs by its path (`--model PATH.gguf`): converted once, keyed by its
content, with its own chat template; an unsupported architecture is refused in one line. The oracle is
transformers' own GGUF loading of the same file (and the model the file was written from)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from ggufs import CHAT_TEMPLATE, FAMILIES, write_tiny_gguf

from kvfuse import checkpoints
from kvfuse.checkpoints import resolve_model_path
from kvfuse.config import CheckpointError, UnsupportedModelError
from kvfuse.text import Tokenizer
from kvfuse.weights import load_model

IDS = [5, 77, 200, 9, 33, 100, 4, 250, 17, 64, 3, 128] * 3  # 36 positions: past Gemma's 16-token window


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_of_each_family_runs_as_transformers_reads_it(tmp_path, cache, family: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = tmp_path / f"{family}.gguf"
    written = write_tiny_gguf(file, family)
    path = resolve_model_path(file)
    assert path.parent == cache / "models" and path.name.startswith("gguf-")
    ours = load_model(path).model
    oracle = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=file.name, dtype=torch.float32).eval()
    ids = torch.tensor(IDS)
    with torch.inference_mode():
        got, want, source = ours(ids), oracle(ids[None]).logits[0], written(ids[None]).logits[0]
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    assert float((got - source).abs().max() / source.abs().max()) < 1e-4  # the file holds the model it was written from
    expected_type = {"mistral": "llama", "gemma3": "gemma3_text"}.get(family, family)
    assert ours.cfg.model_type == expected_type
    tok, hf_tok = Tokenizer(path), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=file.name)
    text = "the cat sat on the mat"
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.chat_template == CHAT_TEMPLATE  # the template from the GGUF's metadata


def test_a_gguf_is_converted_once_keyed_by_its_content(tmp_path, cache, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    first = tmp_path / "a.gguf"
    write_tiny_gguf(first, "qwen2")
    path = resolve_model_path(first)
    fingerprint = load_model(path).fingerprint

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(checkpoints, "convert_gguf", no_conversion)
    assert resolve_model_path(first) == path  # the same file: its converted checkpoint
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(first, copy)
    assert resolve_model_path(copy) == path  # the same content under another name
    monkeypatch.undo()
    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(cache))
    other = tmp_path / "b.gguf"
    write_tiny_gguf(other, "qwen2", seed=1)  # another model of the same shape
    assert resolve_model_path(other) != path
    assert load_model(resolve_model_path(other)).fingerprint != fingerprint
    first.write_bytes(other.read_bytes())  # a file changed in place is converted anew
    assert resolve_model_path(first) == resolve_model_path(other)


def test_a_served_gguf_is_named_by_its_file(tmp_path, cache) -> None:  # type: ignore[no-untyped-def]
    from kvfuse.runtime import open_engine

    file = tmp_path / "tiny-qwen3.Q8_0.gguf"
    write_tiny_gguf(file, "qwen3")
    opened = open_engine(str(file), None)
    assert opened.model_id == "tiny-qwen3.Q8_0" and opened.model_path.name.startswith("gguf-")
    assert open_engine(str(opened.model_path), None).model_id == opened.model_path.name  # a dir: its name


def test_an_unsupported_or_broken_gguf_is_refused_in_one_line(tmp_path, cache) -> None:  # type: ignore[no-untyped-def]
    from kvfuse.cli.main import main

    phi = tmp_path / "phi.gguf"
    write_tiny_gguf(phi, "llama", arch="phi3")
    with pytest.raises(UnsupportedModelError, match=r"GGUF architecture 'phi3' is not supported; kvfuse runs "
                                                    r"llama, qwen2, qwen3, gemma3") as e:
        resolve_model_path(phi)
    assert "\n" not in str(e.value)
    assert not (cache / "models").exists() or not any((cache / "models").glob("gguf-*"))  # nothing converted
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        resolve_model_path(broken)
    with pytest.raises(CheckpointError, match="no such file"):
        resolve_model_path(tmp_path / "missing.gguf")
    with pytest.raises(SystemExit, match=f"kvfuse: {phi}: GGUF architecture 'phi3' is not supported"):
        main(["generate", "--question", "q", "--model", str(phi)])
