"""Batched decoding: requests stepped together get exactly the tokens they get stepped alone."""

import pytest
import torch
from conftest import rand_ids

from kvfuse.drafts import DRAFT_TOKENS
from kvfuse.engine import Engine, Request
from kvfuse.engine.decode import Slot, batch_limit, step_hidden, step_rows
from kvfuse.engine.sampling import SamplingParams
from kvfuse.engine.scheduler import USUAL_ROWS
from kvfuse.model import SPLIT_KEYS


def _request(seed: int, n_chunks: int) -> Request:
    return Request(prefix=(1,) + rand_ids(5 + seed, seed), chunks=tuple(rand_ids(7 + 3 * i, seed + i) for i in
                   range(n_chunks)), suffix=rand_ids(4, seed + 50))


# Requests of different lengths, modes, sampling and stopping: greedy (screened head), seeded
# temperature sampling, recorded logits (the plain head), a stop token, max_tokens of 1, and the
# OpenAI logit adjustments (logit_bias, presence and frequency penalties).
CASES = [
    (0, "full", None, SamplingParams(max_tokens=9, ignore_eos=True), False),
    (1, "blend", 0.5, SamplingParams(max_tokens=7, ignore_eos=True), False),
    (2, "full", None, SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True), False),
    (3, "reuse", None, SamplingParams(max_tokens=6, ignore_eos=True), True),
    (4, "full", None, SamplingParams(max_tokens=1, ignore_eos=True), False),
    # logit_bias and penalties: greedy over the adjusted logits (no screen), and seeded sampling
    (5, "full", None, SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=((7, 5.0), (9, -100.0)),
                                     frequency_penalty=1.5, presence_penalty=0.5), False),
    (6, "blend", 0.5, SamplingParams(max_tokens=7, temperature=0.8, seed=3, ignore_eos=True,
                                     presence_penalty=-1.0), False),
]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "w8a8"])
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_stepping_together_equals_stepping_alone(engine_at, family: str, precision: str) -> None:
    e = engine_at(family, precision)
    assert e.decode_batch_limit() >= 2  # (tiny shapes batch 2 rows bitwise on x86; Gemma's up to 15)
    reqs = [(_request(seed, 1 + seed % 3), mode, ratio, params, rec) for seed, mode, ratio, params, rec in CASES]
    for r, mode, *_ in reqs:
        e.precompute(r, mode)
    alone = [e.generate(r, mode, ratio, params, record_logits=rec) for r, mode, ratio, params, rec in reqs]
    # a stop token halfway through one request: it leaves the batch early
    toks = alone[0].tokens
    k = max([i for i, t in enumerate(toks) if t not in toks[:i]])  # the last new token: stop there
    stop_at = toks[k]
    stopped = SamplingParams(max_tokens=9, stop_token_ids=(stop_at,))
    alone_stop = e.generate(reqs[0][0], "full", None, stopped)
    batch = [e.begin(r, mode, ratio, params, record_logits=rec) for r, mode, ratio, params, rec in reqs]
    batch.append(e.begin(reqs[0][0], "full", None, stopped))
    steps = 0
    while not all(d.done for d in batch):
        e.advance(batch)
        steps += 1
    together = [d.close() for d in batch]
    assert steps <= max(p.max_tokens for *_, p, _ in reqs) - 1  # fewer where a greedy draft was taken
    for a, t in zip(alone + [alone_stop], together, strict=True):
        assert t.tokens == a.tokens
        assert t.finish_reason == a.finish_reason
        if a.step_logits is not None:
            assert t.step_logits is not None and torch.equal(t.step_logits, a.step_logits)
    assert together[-1].finish_reason == "stop" and together[-1].tokens == toks[:k]


def test_batch_limit_finds_a_step_that_depends_on_the_batch(tiny_engines, monkeypatch) -> None:
    e = tiny_engines["gemma3"]
    m = e.model
    assert batch_limit(m, 2) == 2
    assert batch_limit(m, 1) == 1
    finish = m.finish

    def leaky(i: int, h: torch.Tensor, a: torch.Tensor, step: bool = False) -> torch.Tensor:  # rows see each other
        out = finish(i, h, a, step)
        return out + 1e-3 * h.sum(0)

    monkeypatch.setattr(m, "finish", leaky)
    assert batch_limit(m, 2) == 1


def test_advance_skips_finished_requests(tiny_engines) -> None:
    e = tiny_engines["gemma3"]
    r = _request(7, 2)
    one = e.begin(r, "full", None, SamplingParams(max_tokens=1, ignore_eos=True))
    assert one.done and len(one.tokens) == 1
    e.advance([one])  # nothing to do
    assert len(one.tokens) == 1 and one.slot is None
    g = one.close()
    assert g.tokens == one.tokens and g.finish_reason == "length"
    assert one.close() is g  # closing again changes nothing


def test_a_request_stores_its_prompt_when_it_starts(tiny_engines) -> None:
    """The next request finds this one's prefix blocks while this one still decodes, as it would after it."""
    e = tiny_engines["mistral"]
    shared = (1,) + rand_ids(40, 70)
    a, b = (Request(prefix=shared + rand_ids(3, s), suffix=rand_ids(2, s + 1)) for s in (80, 90))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    first = e.begin(a, "prefix", None, params)
    assert not first.done
    second = e.begin(b, "prefix", None, params)  # the first has not closed
    assert second.pre.counts.cached == len(shared) // e.block_size * e.block_size > 0
    for d in (first, second):
        d.close()


def test_one_request_failing_in_a_step_leaves_the_others(tiny_engines, monkeypatch) -> None:
    from kvfuse.engine import scheduler as engine_mod  # where steps sample

    e = tiny_engines["gemma3"]
    sample = engine_mod.sample

    calls: list[int] = []

    def picky(logits, params, gen=None, generated=()):  # type: ignore[no-untyped-def]
        if params.seed == 13:  # a request whose sampling fails after its first token
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("probabilities are not finite")
        return sample(logits, params, gen, generated)

    reqs = [_request(s, 1) for s in (20, 21)]
    alone = e.generate(reqs[0], "full", None, SamplingParams(max_tokens=4, ignore_eos=True)).tokens
    monkeypatch.setattr(engine_mod, "sample", picky)
    good = e.begin(reqs[0], "full", None, SamplingParams(max_tokens=4, ignore_eos=True))
    bad = e.begin(reqs[1], "full", None, SamplingParams(max_tokens=4, temperature=0.7, seed=13, ignore_eos=True))
    e.advance([good, bad])
    assert bad.done and isinstance(bad.error, RuntimeError) and len(bad.tokens) == 1
    while not good.done:
        e.advance([good, bad])
    assert good.error is None and good.close().tokens == alone
    calls.clear()
    stream = e.stream(reqs[1], "full", None, SamplingParams(max_tokens=4, temperature=0.7, seed=13, ignore_eos=True))
    assert len([next(stream)]) == 1  # the first token comes; the failure surfaces at the next
    with pytest.raises(RuntimeError, match="not finite"):
        next(stream)
    assert stream.result is not None and len(stream.result.tokens) == 1


def test_advance_steps_in_groups_of_the_checked_limit(tiny_engines, monkeypatch) -> None:
    e: Engine = tiny_engines["qwen3"]
    monkeypatch.setattr(e.scheduler, "_batch_limit", None)  # restored afterwards, even if this fails
    monkeypatch.setattr("kvfuse.engine.scheduler.MAX_DECODE_BATCH", 3)
    sizes: list[int] = []
    step = e.scheduler._step
    monkeypatch.setattr(e, "draft_tokens", 0)  # one token a step, to count them
    monkeypatch.setattr(e.scheduler, "_step", lambda live, rows: (sizes.append(len(live)), step(live, rows)))
    batch = [e.begin(_request(s, 1), "full", None, SamplingParams(max_tokens=3, ignore_eos=True)) for s in range(7)]
    limit = e.decode_batch_limit()
    assert 2 <= limit <= 3
    e.advance(batch)
    assert sizes == [limit] * (7 // limit) + ([7 % limit] if 7 % limit else [])
    for d in batch:
        assert len(d.tokens) == 2
        d.close()


@pytest.fixture(scope="module")
def gemma_wide(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A 2-layer Gemma 3 with Gemma 3 270M's widths (hidden 640, MLP 2048, 4 x 256 query heads, 1 kv head):
    the shapes decide how many rows the BLAS keeps bitwise equal, and the tiny configs keep only 2."""
    import dataclasses

    import transformers as tf
    from tiny import hf_config

    from kvfuse.weights import load_model

    cfg = hf_config("gemma3").to_dict()
    cfg.update(hidden_size=640, intermediate_size=2048, num_key_value_heads=1, head_dim=256, num_hidden_layers=2,
               layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=256,
               max_position_embeddings=2048)
    root = tmp_path_factory.mktemp("gemma-wide")
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.Gemma3TextConfig(**cfg), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(root, safe_serialization=True)
    lm = load_model(root)
    e = Engine(lm.model, lm.fingerprint)
    e.cfg = dataclasses.replace(e.cfg, eos_token_ids=())
    return e


def test_wide_rows_step_together_in_batches_of_more_than_two(gemma_wide, monkeypatch) -> None:
    from kvfuse.engine import decode

    e = gemma_wide
    limit = e.decode_batch_limit()
    if limit < 4:
        pytest.skip(f"this machine's BLAS keeps only {limit} rows bitwise equal at Gemma's widths (8 on x86 dev)")
    reqs = [_request(s, 1 + s % 3) for s in range(6)]
    params = [SamplingParams(max_tokens=6, **({"temperature": 0.8, "seed": s} if s % 2 else {})) for s in range(6)]
    rec = [s % 3 == 0 for s in range(6)]  # some record their logits: compared bitwise
    alone = [e.generate(r, "full", None, p, record_logits=k) for r, p, k in zip(reqs, params, rec, strict=True)]
    batch = [e.begin(r, "full", None, p, record_logits=k) for r, p, k in zip(reqs, params, rec, strict=True)]
    sizes: list[int] = []
    step = e.scheduler._step
    e.scheduler._step = lambda live, rows: (sizes.append(len(live)), step(live, rows))  # type: ignore[method-assign]
    try:
        while not all(d.done for d in batch):
            e.advance(batch)
    finally:
        del e.scheduler._step
    assert max(sizes) == min(6, limit) > 2
    together = [d.close() for d in batch]
    assert [g.tokens for g in together] == [g.tokens for g in alone]
    for g, a, k in zip(together, alone, rec, strict=True):
        assert not k or (g.step_logits is not None and a.step_logits is not None
                         and torch.equal(g.step_logits, a.step_logits))
    # The premise of the padding row: unpadded, a lone request's step is not bitwise a batch row.
    monkeypatch.setattr(decode, "MIN_ROWS", 1)
    lone = e.generate(reqs[0], "full", None, params[0], record_logits=True).step_logits
    assert lone is not None and together[0].step_logits is not None
    assert not torch.equal(lone[1:], together[0].step_logits[1:])


def test_wide_drafts_verify_several_rows_and_answer_as_plain_greedy(gemma_wide, monkeypatch) -> None:
    """A greedy request that drafts up to 6 tokens a step (more in a run of drafts taken whole, within a
    step's rows) gets plain greedy decoding's tokens, in fewer steps, alone and beside a sampled request
    that drafts too (Gemma 3 270M's widths keep up to 16 rows bitwise here)."""
    e = gemma_wide
    limit = e.decode_batch_limit()
    if limit < 4:
        pytest.skip(f"this machine's BLAS keeps only {limit} rows bitwise equal at Gemma's widths")
    # a prompt that repeats itself: greedy decoding of random weights soon copies it or loops
    reqs = [Request(prefix=(1,) + rand_ids(6, s) * 4, chunks=(), suffix=rand_ids(6, s)) for s in range(3)]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    monkeypatch.setattr(e, "draft_tokens", 0)
    plain = [e.generate(r, "full", None, greedy) for r in reqs]
    sampled = e.generate(reqs[0], "full", None, SamplingParams(max_tokens=24, temperature=0.7, seed=1))
    monkeypatch.setattr(e, "draft_tokens", 6)
    drafted = [e.generate(r, "full", None, greedy) for r in reqs]
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert sum(g.drafts.accepted for g in drafted) > 0
    assert all(g.drafts.drafted <= g.drafts.steps * (limit - 1) for g in drafted)  # a step's rows bound a draft
    if limit > DRAFT_TOKENS + 1:  # drafts taken whole in a run (a loop) grow past the usual length
        assert any(g.drafts.drafted > g.drafts.steps * DRAFT_TOKENS for g in drafted)
    batch = [e.begin(r, "full", None, greedy) for r in reqs]
    batch.append(e.begin(reqs[0], "full", None, SamplingParams(max_tokens=24, temperature=0.7, seed=1)))
    e.advance(batch)  # the first step: every request's prompt repeats, so each has a draft to propose
    assert [d.drafts.steps for d in batch] == [1] * len(batch)  # the step's spare rows are shared by all
    # no request is in a run of drafts taken whole yet: the step stays within its usual rows
    assert sum(d.drafts.drafted for d in batch) <= min(limit, USUAL_ROWS) - len(batch)
    greedy_steps = 1  # steps until the greedy ones are done (the sampled one takes 23)
    while not all(d.done for d in batch):
        e.advance(batch)
        greedy_steps += not all(d.done for d in batch[:3])
    together = [d.close() for d in batch]
    assert [g.tokens for g in together] == [g.tokens for g in plain] + [sampled.tokens]
    # the sampled one drafts too (rejection rule), and still gets the very tokens it got alone undrafted
    assert together[-1].drafts.steps > 0
    assert greedy_steps < 22  # the greedy ones drafted in the rows the sampled one left


@pytest.mark.parametrize("keys", [SPLIT_KEYS + 100, SPLIT_KEYS + 101])
def test_wide_rows_over_many_keys_equal_stepping_one_token_at_a_time(gemma_wide, keys: int) -> None:
    """Past SPLIT_KEYS keys, one kv head's weighted values are summed in two halves (`model._weighted_values`):
    a slot's drafted rows still equal stepping their tokens one at a time, at odd and even key counts, and
    the step's hidden states stay those of a full prefill of the same tokens."""
    e = gemma_wide
    if e.decode_batch_limit() < 4:
        pytest.skip("this machine's BLAS keeps fewer than 4 rows bitwise equal at Gemma's widths")
    toks = list(rand_ids(4, 7))
    with torch.inference_mode():
        req = Request(prefix=(1,) + rand_ids(keys - 5, 3), chunks=(), suffix=rand_ids(4, 4))
        fused = e.prefill(req, room=8).fused
        one = Slot(e.model, fused.cache, 8)
        seq = torch.cat([step_hidden(e.model, [one], [t]) for t in toks])
        rows = step_rows(e.model, [Slot(e.model, fused.cache, 8)], [toks])
        full = e.model(torch.tensor(list(req.prefix + req.suffix) + toks))[-4:]  # the naive path's logits
        steps = e.model.logits(seq)
    assert torch.equal(rows, seq), (rows - seq).abs().max()
    assert torch.allclose(steps, full, atol=1e-3, rtol=1e-3), (steps - full).abs().max()


def test_the_batch_checks_answer_is_kept_per_model_software_and_machine(tiny_models, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A loaded engine's batch check runs once per model, screen kernel, torch, CPU and thread count:
    the next process (a CLI command is one) reads its answer; anything else that picks kernels checks
    again, and a damaged file is checked over."""
    from kvfuse.engine import scheduler

    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path))
    checks: list[int] = []
    real = scheduler.batch_limit
    monkeypatch.setattr(scheduler, "batch_limit", lambda *a, **k: checks.append(1) or real(*a, **k))
    root = tiny_models["llama"][0]
    first = Engine.load(root, self_check=False).decode_batch_limit()
    assert checks == [1] and (tmp_path / "batch-limits.json").is_file()
    assert Engine.load(root, self_check=False).decode_batch_limit() == first and checks == [1]
    assert Engine.load(root, precision="bf16", self_check=False).decode_batch_limit() >= 1 and len(checks) == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        Engine.load(root, self_check=False).decode_batch_limit()
        assert len(checks) == 3
    finally:
        torch.set_num_threads(threads)
    (tmp_path / "batch-limits.json").write_text("{not json")
    assert Engine.load(root, self_check=False).decode_batch_limit() == first and len(checks) == 4
    assert Engine.load(root, self_check=False).decode_batch_limit() == first and len(checks) == 4
