"""`make run`: answer a bundled cross-passage question with `full` and `blend`, and compare TTFT."""

from __future__ import annotations

import json
from importlib import resources

from kvfuse.engine import Engine
from kvfuse.sampling import SamplingParams
from kvfuse.text import Prompt, Tokenizer, complete_text
from kvfuse.weights import resolve_model_path


def run_demo(model: str | None = None) -> int:
    data = json.loads(resources.files("kvfuse").joinpath("data/demo.json").read_text(encoding="utf-8"))
    print("Loading the model (the first run converts Gemma 3 270M once)...", flush=True)
    path = resolve_model_path(model)
    engine = Engine.load(path)
    tok = Tokenizer(path)
    prompt = Prompt(chunks=tuple(data["passages"]), question=data["question"])
    req = prompt.request(tok)
    params = SamplingParams(max_tokens=24)
    print(f"\nQuestion: {data['question']}  (expected: {data['answer']})")
    print(f"Context: {len(data['passages'])} passages, {len(req)} tokens\n")
    for mode in ("full", "blend"):
        precompute_s = engine.precompute(req, mode)
        stream = engine.stream(req, mode, None, params)
        answer = complete_text(stream, tok).strip()
        res = stream.result
        assert res is not None
        extra = f", chunk caches precomputed in {precompute_s:.3f}s beforehand" if mode == "blend" else ""
        print(f"{mode:>5}: {answer!r}")
        print(f"       TTFT {res.ttft_s * 1000:.0f} ms, recomputed {res.counts.recomputed} of "
              f"{res.counts.reused} reused tokens{extra}")
    return 0
