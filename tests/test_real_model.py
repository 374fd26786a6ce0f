"""The real default model (Gemma 3 270M): marked slow, and CI runs them."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MUSIQUE, hf_reference

from kvfuse.checkpoints import resolve_model_path
from kvfuse.drafts import propose
from kvfuse.engine import Engine, Request
from kvfuse.engine.sampling import SamplingParams
from kvfuse.metrics import kl_divergence
from kvfuse.precision import default_precision
from kvfuse.text import Prompt, Tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real():  # type: ignore[no-untyped-def]
    path = resolve_model_path(None)
    return Engine.load(path), Tokenizer(path), path


def _cases() -> list[dict]:
    return json.loads(MUSIQUE.read_text())


def _request(tok: Tokenizer, case: dict, n_passages: int):  # type: ignore[no-untyped-def]
    return Prompt(chunks=tuple(c["text"] for c in case["ctxs"][:n_passages]), question=case["question"]).request(tok)


_kl = kl_divergence


def test_real_logits_match_hf(real) -> None:  # type: ignore[no-untyped-def]
    engine, tok, path = real
    hf = hf_reference(path)
    ids = torch.tensor(_request(tok, _cases()[0], 2).ids[:700])  # longer than the 512-token window
    with torch.inference_mode():
        ours, ref = engine.model(ids), hf(ids[None]).logits[0]
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel < 1e-4, f"max relative logit difference {rel:.2e}"


def test_real_prefix_and_blend_at_one_equal_full(real) -> None:  # type: ignore[no-untyped-def]
    engine, tok, _ = real
    req = _request(tok, _cases()[1], 3)
    full = engine.prefill(req, "full").fused.logits
    for mode, ratio in (("prefix", None), ("blend", 1.0), ("queryaware", 1.0)):
        engine.precompute(req, mode)
        got = engine.prefill(req, mode, ratio).fused.logits
        rel = float((got - full).abs().max() / full.abs().max())
        assert rel < 1e-4, f"{mode}: max relative difference {rel:.2e}, mean {(got - full).abs().mean():.2e}"


def test_real_default_mode_is_closer_to_full_than_blend(real) -> None:  # type: ignore[no-untyped-def]
    """The default (queryaware@0.2 over chunks behind a copy of themselves) beats blend@0.15 and reuse on
    real passages (cases the calibration never saw; docs/benchmarks.md has the 50-case figures)."""
    from kvfuse.fuse import DEFAULT_MODE

    engine, tok, _ = real
    kl: dict[str, list[float]] = {"reuse": [], "blend": [], DEFAULT_MODE: []}
    for case in _cases()[5:8]:
        req = _request(tok, case, 4)
        full = engine.prefill(req, "full").fused.logits
        for mode in kl:
            engine.precompute(req, mode)
            kl[mode].append(_kl(full, engine.prefill(req, mode).fused.logits))
    assert sum(kl[DEFAULT_MODE]) < min(sum(kl["blend"]), sum(kl["reuse"])), kl
    assert sum(d < r for d, r in zip(kl[DEFAULT_MODE], kl["reuse"], strict=True)) >= 2, kl


def test_real_blend_is_closer_to_full_than_reuse(real) -> None:  # type: ignore[no-untyped-def]
    engine, tok, _ = real
    kl_reuse, kl_blend = [], []
    for case in _cases()[2:5]:
        req = _request(tok, case, 4)
        full = engine.prefill(req, "full").fused.logits
        engine.precompute(req, "blend")
        kl_reuse.append(_kl(full, engine.prefill(req, "reuse").fused.logits))
        kl_blend.append(_kl(full, engine.prefill(req, "blend", 0.15).fused.logits))
    assert sum(kl_blend) < sum(kl_reuse), f"blend KL {kl_blend} vs reuse KL {kl_reuse}"
    assert sum(b < r for b, r in zip(kl_blend, kl_reuse, strict=True)) >= 2


def test_cli_generate_json_in_every_mode(real, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from kvfuse.cli import main

    case = _cases()[0]
    files = []
    for i, c in enumerate(case["ctxs"][:3]):
        f = tmp_path / f"chunk{i}.txt"
        f.write_text(c["text"])
        files += ["--chunk-file", str(f)]
    prefix = tmp_path / "prefix.txt"
    prefix.write_text("Passages follow.")
    outs = {}
    for mode, ratio in (("full", []), ("prefix", []), ("reuse", []), ("blend", ["--ratio", "1.0"]), ("blend", [])):
        argv = ["generate", "--prefix-file", str(prefix), *files, "--question", case["question"], "--mode", mode,
                *ratio, "--max-tokens", "8", "--json", "--store", str(tmp_path / "store")]
        assert main(argv) == 0
        out = json.loads(capsys.readouterr().out)
        assert set(out) == {"answer", "mode", "fuser", "ratio", "precision", "ttft_s", "precompute_s", "tokens",
                            "first_token_top", "store", "controller"}
        assert out["precision"] == default_precision()  # the CLI's default follows the CPU
        assert set(out["store"]) == {"hits", "misses", "corrupt", "bytes_read", "tiers_used"}
        assert set(out["tokens"]) == {"prompt", "prefilled", "reused", "recomputed"}
        assert len(out["first_token_top"]) == 20 and out["ttft_s"] > 0
        assert out["tokens"]["prompt"] == out["tokens"]["prefilled"] + out["tokens"]["reused"]
        outs[(mode, tuple(ratio))] = out
    full = outs[("full", ())]
    assert full["precompute_s"] == 0 and full["tokens"]["reused"] == 0
    assert outs[("prefix", ())]["answer"] == full["answer"] and outs[("prefix", ())]["tokens"]["reused"] > 0
    assert outs[("blend", ("--ratio", "1.0"))]["answer"] == full["answer"]
    assert outs[("blend", ())]["ratio"] == 0.15 and 0 < outs[("blend", ())]["tokens"]["recomputed"]
    # a fixed ratio still reports the controller's predictions; each run is a new engine, so the chunk
    # caches the previous runs wrote back come from disk
    ctl = outs[("blend", ())]["controller"]
    assert ctl["ratio"] == 0.15 and ctl["tier"] == "disk" and ctl["predicted_recompute_s"] > 0
    assert outs[("blend", ())]["store"]["tiers_used"] == ["disk"]
    assert full["controller"] is None
    assert full["first_token_top"][0][0] == outs[("prefix", ())]["first_token_top"][0][0]


def test_cli_rejects_bad_input(real, capsys) -> None:  # type: ignore[no-untyped-def]
    from kvfuse.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--question", "q", "--ratio", "2"])
    assert e.value.code == 2 and "between 0 and 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="cannot read --chunk-file /nonexistent"):
        main(["generate", "--question", "q", "--chunk-file", "/nonexistent"])


def _cli(*args: str) -> dict:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvfuse", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_restart_reuses_chunk_caches_from_disk(real, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A second process answers from the chunk caches a first process wrote to disk."""
    case = _cases()[6]
    files = []
    for i, c in enumerate(case["ctxs"][:4]):
        f = tmp_path / f"c{i}.txt"
        f.write_text(c["text"])
        files += ["--chunk-file", str(f)]
    store = str(tmp_path / "store")
    argv = ["generate", *files, "--question", case["question"], "--mode", "blend", "--max-tokens", "8",
            "--json", "--store", store]
    first, second = _cli(*argv), _cli(*argv)
    assert first["store"]["tiers_used"] == ["memory"] and first["precompute_s"] > 0.5  # prepared, then hit
    assert second["store"]["hits"] >= 4 and second["store"]["tiers_used"] == ["disk"]
    assert second["store"]["bytes_read"] > 0 and second["precompute_s"] < 0.1
    assert second["answer"] == first["answer"] and second["first_token_top"][0] == first["first_token_top"][0]
    stats = _cli("store", "stats", "--store", store)
    assert stats["entries"] >= 4 and stats["bytes"] > 0
    assert _cli("store", "verify", "--store", store)["corrupt"] == []
    assert _cli("store", "clear", "--store", store)["removed"] == stats["entries"]


def test_cli_profile_and_precompute(real, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import os

    (tmp_path / "cache").mkdir()
    os.symlink(real[2].parent, tmp_path / "cache" / "models")  # the converted model, in a fresh cache dir
    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path / "cache"))
    prof = _cli("profile", "--json", "--store", str(tmp_path / "store"))
    assert set(prof) >= {"kv_bytes_per_token", "prefill_s_per_token", "tiers", "recommended_tier", "ratio_by_tier"}
    from kvfuse.precision import default_precision

    # K and V, 18 layers, one 256-wide kv head, stored in what holds the CLI default's KV exactly: bfloat16
    # for bf16 (its keys and values are rounded to it as computed), float32 for the others
    itemsize = 2 if default_precision() == "bf16" else 4
    assert prof["kv_bytes_per_token"] == 2 * 18 * 256 * itemsize
    assert set(prof["tiers"]) == {"memory", "disk"} and prof["recommended_tier"] in prof["tiers"]
    assert all(t["read_bytes_per_s"] > 0 and "cost_per_gb" in t for t in prof["tiers"].values())
    assert all(0.15 <= r <= 1.0 for r in prof["ratio_by_tier"].values())
    chunk = tmp_path / "c.txt"
    chunk.write_text(_cases()[7]["ctxs"][0]["text"])
    store = str(tmp_path / "store")
    first = _cli("precompute", "--chunk-file", str(chunk), "--store", store)
    again = _cli("precompute", "--chunk-file", str(chunk), "--store", store)
    assert (first["computed"], again["computed"], again["already_cached"]) == (1, 0, 1)
    # precompute stores what the default mode reads (queryaware: chunks behind a copy of themselves)
    out = _cli("generate", "--chunk-file", str(chunk), "--question", "Who?", "--mode", "queryaware", "--ratio", "auto",
               "--max-tokens", "4", "--json", "--store", store)
    assert out["controller"]["tier"] == "disk" and out["ratio"] == out["controller"]["ratio"] >= 0.15
    assert out["store"]["hits"] >= 1 and "disk" in out["store"]["tiers_used"]  # the chunk came from disk
    assert out["tokens"]["reused"] >= len(_cases()[7]["ctxs"][0]["text"]) // 8  # and was not recomputed whole


def test_real_screened_greedy_decoding_equals_the_float32_head(real) -> None:  # type: ignore[no-untyped-def]
    """The int8 screen of Gemma's 262k-row head picks exactly the float32 argmax, step after step."""
    engine, tok, _ = real
    plain = Engine(engine.model, engine.fingerprint, self_check=False, greedy_screen=False)
    assert engine.greedy_head() is not None
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for case in _cases()[:3]:
        req = _request(tok, case, 2)
        screened = engine.generate(req, "full", params=params).tokens
        assert screened == plain.generate(req, "full", params=params).tokens


def test_real_batched_decoding_equals_decoding_alone(real) -> None:  # type: ignore[no-untyped-def]
    """Gemma's decoding steps batch requests without changing a token: greedy through the int8 screen,
    and sampled, stepped together in groups of the checked limit against each stepped alone."""
    from kvfuse.engine.sampling import SamplingParams

    engine, tok, _ = real
    limit = engine.decode_batch_limit()
    assert limit >= 2, "no batch is bitwise equal to decoding alone on this machine"  # 8 on the dev machine
    reqs = [_request(tok, case, 2) for case in _cases()[:5]]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, **({"temperature": 0.8, "seed": i} if i % 2 else {}))
              for i in range(5)]
    alone = [engine.generate(r, "reuse", params=p).tokens for r, p in zip(reqs, params, strict=True)]
    batch = [engine.begin(r, "reuse", None, p) for r, p in zip(reqs, params, strict=True)]
    while not all(d.done for d in batch):
        engine.advance(batch)
    assert [d.close().tokens for d in batch] == alone


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_real_precisions_stay_close_to_fp32_and_exact_within_themselves(real, precision: str) -> None:  # type: ignore[no-untyped-def]
    """Every precision stays close to fp32 at the first token on real passages (fp32's token among its
    top 3, small KL), its fusers are available (the self-check passes), and prefix and blend@1.0 still
    equal its own full prefill."""
    engine, tok, path = real
    low = Engine.load(path, precision=precision)
    assert low.blend_error is None and low.precision == precision and low.fingerprint != engine.fingerprint
    kls = []
    for case in _cases()[:2]:
        req = _request(tok, case, 2)  # about 1k tokens: bf16 matmuls without AMX (AVX2 only) are slow
        ref = engine.prefill(req, "full").fused.logits
        full = low.prefill(req, "full").fused.logits
        kls.append(_kl(ref, full))
        assert int(ref.argmax()) in full.topk(3).indices.tolist()  # near ties may swap (0.90 agree on 10 cases)
        for mode, ratio in (("prefix", None), ("blend", 1.0)):
            low.precompute(req, mode)
            got = low.prefill(req, mode, ratio).fused.logits
            assert int(got.argmax()) == int(full.argmax()), mode
            assert _kl(full, got) < 0.01, mode
    assert 0 < max(kls) < 0.05, kls


LOAD_RSS = """
import json, math, sys
from pathlib import Path

def rss(field):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024

from kvfuse.checkpoints import gguf_of, resolve_model_path
from kvfuse.gguffile import read_header

from kvfuse.weights import load_model
path = resolve_model_path(None)
weights = sum(math.prod(t.shape) for t in read_header(gguf_of(path)).tensors.values())
before = rss("VmRSS")
load_model(path, sys.argv[1])
print(json.dumps({"growth": rss("VmHWM") - before, "kept": rss("VmRSS") - before, "file": 4 * weights}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the kernel's RSS counters")
def test_real_int8_load_never_holds_the_float_checkpoint(real) -> None:  # type: ignore[no-untyped-def]
    """Loading converts one part at a time, read from the GGUF, and the tied table a block of rows at a
    time: an int8 load's peak RSS grows by well under the float32 checkpoint's size
    (measured 0.39x; reading it whole first grew by 1.36x, and reading the 671 MB table whole by 0.89x),
    and what stays is about the int8 model (257 MB), not the file's pages or the heap's freed copies."""
    out = subprocess.run([sys.executable, "-c", LOAD_RSS, "int8"], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["growth"] < 0.6 * got["file"], got
    assert got["kept"] < 0.3 * got["file"], got


@pytest.mark.parametrize("name", ["gemma3-270m", "smollm2-135m-instruct"])
def test_real_tokenizer_reads_what_the_models_own_class_reads(name: str) -> None:
    """`Tokenizer` reads tokenizer.json with the `tokenizers` library, without transformers (which it
    loads only for a Jinja template); the oracle is transformers' AutoTokenizer."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name)
    ours, oracle = Tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert ours._hf is None  # read without transformers
    case = _cases()[3]
    text = "\n\n".join(c["text"] for c in case["ctxs"]) + " Ünïcödé 日本語 emoji 🙂\t  tabs  and  spaces \n"
    ids = oracle.encode(text, add_special_tokens=False)
    assert ours.encode(text) == ids
    got_ids, spans = ours.encode_offsets(text)
    want = oracle(text, add_special_tokens=False, return_offsets_mapping=True)
    assert got_ids == ids and spans == [tuple(s) for s in want["offset_mapping"]]
    assert ours.decode(ids) == oracle.decode(ids, skip_special_tokens=True)
    marked = oracle.eos_token + text[:300] + oracle.bos_token + " <end_of_turn> <|im_start|>user\n"
    assert ours.encode(marked) == oracle.encode(marked, add_special_tokens=False, split_special_tokens=True)
    assert ours.encode_markup(marked) == oracle.encode(marked, add_special_tokens=False)
    assert ours.encode_markup(marked) != ours.encode(marked)  # the markup's control tokens are tokens
    with_controls = oracle.encode(marked, add_special_tokens=False)
    assert ours.decode(with_controls) == oracle.decode(with_controls, skip_special_tokens=True)
    assert ours.bos_id == oracle.bos_token_id
    assert [ours.token_text(i) for i in ids[:200]] == oracle.convert_ids_to_tokens(ids[:200])
    assert ours.chat_template == (oracle.chat_template or None)
    if ours.chat_template:
        chat = [{"role": "user", "content": case["question"]}]
        assert ours.render_chat(chat, True) == oracle.apply_chat_template(chat, tokenize=False,
                                                                          add_generation_prompt=True)


def _checkpoint_state(path: Path) -> dict[str, torch.Tensor]:
    """fp32's weights: gguf's own dequantisation of the file, as transformers converts it (test_gguf.py)."""
    from kvfuse.weights import load_model

    return dict(load_model(path, "fp32").model.state_dict())


def test_real_groups_holds_the_packaged_ggufs_blocks_exactly(real) -> None:  # type: ignore[no-untyped-def]
    """Precision groups on Gemma 3 270M: every linear (Q5_0, Q8_0, Q4_K, Q6_K blocks) and the tied Q8_0
    table read from the GGUF and dequantising to the converted checkpoint bit for bit; at 1.25 bytes a
    weight it computes fp32's function, fusion's guarantees hold, and a greedy answer is fp32's."""
    from kvfuse import groups
    from kvfuse.engine.sampling import SamplingParams

    engine, tok, path = real
    grouped = Engine.load(path, precision="groups")
    model = grouped.model
    state = _checkpoint_state(path)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, groups.GroupLinear)}
    assert len(linears) == 4 * model.cfg.num_layers
    assert {m.size for m in linears.values()} == {16, 32}  # Q6_K's sub-blocks of 16 among them
    assert any(m.offset is not None for m in linears.values())  # Q4_K's minimums
    for name, lin in linears.items():
        assert torch.equal(lin.groups.dequantize(), state.pop(f"{name}.weight")), name
    table = model.embed_tokens
    assert isinstance(table, groups.GroupEmbedding)
    whole = state["embed_tokens.weight"]
    assert all(torch.equal(table.groups.rows(slice(a, a + 32768)).dequantize(), whole[a : a + 32768])
               for a in range(0, table.num_embeddings, 32768))
    weights = sum(m.values.numel() for m in model.modules() if isinstance(m, groups.GroupRows))
    held = sum(m.groups.nbytes for m in model.modules() if isinstance(m, groups.GroupRows))
    assert held < 1.3 * weights  # int8 values and a float32 scale (offset) per group of 32 (16)
    assert grouped.blend_error is None
    req = _request(tok, _cases()[3], 3)
    with torch.inference_mode():
        got, want = model(torch.tensor(req.ids[:800])), engine.model(torch.tensor(req.ids[:800]))
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    params = SamplingParams(max_tokens=16)
    assert grouped.generate(req, "full", None, params).tokens == engine.generate(req, "full", None, params).tokens


def test_real_grammar_lookahead_is_the_masks_of_taking_the_draft(real) -> None:  # type: ignore[no-untyped-def]
    """`Grammar.lookahead` (a draft's masks under response_format's grammar) on Gemma's vocabulary: the
    mask before each token of a valid answer as taking them one by one gives, the state left unchanged,
    and a token the grammar forbids ends the walk there."""
    from kvfuse.server.grammar import Grammar, grammar_for

    _, tok, _ = real
    schema = {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"],
              "additionalProperties": False}
    text = grammar_for({"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    assert text is not None
    vocab = len(tok.hf)
    answer = tok.encode('{"days":30}')
    g, walk = Grammar(tok.hf, text), Grammar(tok.hf, text)
    masks = g.lookahead(answer, vocab)
    assert len(masks) == len(answer)  # stopped once the object is complete: no mask after its last token
    for i, t in enumerate(answer[: len(masks)]):
        assert torch.equal(masks[i], walk.allowed(vocab)), i
        walk.advance(t)
    assert torch.equal(g.allowed(vocab), masks[0])  # rolled back
    bad = tok.encode("x")[0]
    assert not bool(masks[2][bad])
    assert len(g.lookahead([*answer[:2], bad, *answer[3:]], vocab)) == 3  # ends at the forbidden token
    assert torch.equal(g.allowed(vocab), masks[0])


def test_real_bf16_holds_its_table_in_the_ggufs_own_q8_0_groups(real, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """bf16 keeps the embedding table and LM head in float32; the packaged GGUF holds them in Q8_0 groups
    that dequantise to exactly those values, so bf16 holds the groups (a quarter of the bytes) and
    answers as it did with the float table."""
    from kvfuse import groups, weights
    from kvfuse.engine.sampling import SamplingParams

    engine, tok, path = real
    bf16 = Engine.load(path, precision="bf16")
    table = bf16.model.embed_tokens
    assert isinstance(table, groups.GroupEmbedding) and bf16.greedy_head() is not None
    whole = _checkpoint_state(path)["embed_tokens.weight"]
    assert table.groups.nbytes < 0.3 * whole.numel() * 4
    assert all(torch.equal(table.groups.rows(slice(a, a + 32768)).dequantize(), whole[a : a + 32768])
               for a in range(0, whole.shape[0], 32768))
    monkeypatch.setattr(weights, "reads_blocks", lambda precision, part: precision == "groups")
    plain = Engine.load(path, precision="bf16")  # the float table, as before
    assert isinstance(plain.model.embed_tokens, torch.nn.Embedding) and plain.fingerprint == bf16.fingerprint
    req = _request(tok, _cases()[5], 3)
    params = SamplingParams(max_tokens=16)
    got, want = bf16.generate(req, "full", None, params), plain.generate(req, "full", None, params)
    assert got.tokens == want.tokens
    assert float((got.first_logits - want.first_logits).abs().max() / want.first_logits.abs().max()) < 1e-5


def test_real_drafts_key_a_word_with_and_without_its_leading_space(real) -> None:  # type: ignore[no-untyped-def]
    """Engine.load keys drafts by Gemma's vocabulary: a quote that begins "I" or "Duplicate" matches the
    source's " I" and " Duplicate"; other words keep keys of their own; greedy answers stay as without keys."""
    engine, tok, _ = real
    keys = engine.scheduler.draft_keys
    assert keys is not None and len(keys) >= engine.cfg.vocab_size
    for word in ("I", "Duplicate", "charges"):
        (bare,), (spaced,) = tok.encode(word), tok.encode(" " + word)
        assert bare != spaced and keys[bare] == keys[spaced]
    (a,), (b,) = tok.encode(" refund"), tok.encode(" renewal")
    assert keys[a] != keys[b]
    source = "8. I was charged twice. What happens?\nDuplicate charges are detected automatically and cancelled."
    req = Request(prefix=tuple(tok.encode(source)), suffix=tuple(tok.encode('\nQuote: "I')))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with_keys = engine.generate(req, "prefix", params=params)
    engine.scheduler.draft_keys = None
    try:
        without = engine.generate(req, "prefix", params=params)
    finally:
        engine.scheduler.draft_keys = keys
    assert with_keys.tokens == without.tokens
    # the quote's first draft is found only by its key: "I" after the mark is the source's " I"
    ids = np.array(req.ids, dtype=np.int64)
    follows = tok.encode(" was charged twice. What happens")
    assert propose(ids, 6, keys=keys[ids]) == follows[:6] and propose(ids, 6) == []
