import math
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch
from conftest import rand_ids

from kvfuse import fuse
from kvfuse.engine import Engine, ModeUnavailableError, Request, RequestError
from kvfuse.engine.sampling import SamplingParams, sample
from kvfuse.store.tiered import TieredStore
from kvfuse.weights import load_model

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def _request(seed: int = 0) -> Request:
    return Request(
        prefix=(1,) + rand_ids(19, seed),
        chunks=(rand_ids(15, seed + 1), rand_ids(22, seed + 2), rand_ids(9, seed + 3)),
        suffix=rand_ids(5, seed + 4),
    )


def naive_greedy(model, ids: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """The oracle: a full forward pass over everything so far, for every new token."""
    out = []
    for _ in range(n):
        out.append(int(model(torch.tensor(ids + out))[-1].argmax()))
    return out


@pytest.mark.parametrize("family", ["gemma3", "mistral", "qwen2"])
def test_full_decoding_matches_naive_generate(tiny_engines, family: str) -> None:
    e = tiny_engines[family]
    req = _request(1)
    got = e.generate(req, "full", params=GREEDY).tokens
    with torch.inference_mode():
        assert got == naive_greedy(e.model, req.ids, 10)


# first-token logits, relative to their largest: bfloat16 kernels round differently by shape (the suffix
# runs through the causal kernel in full, the masked one after a cache), a few of its 8-bit roundings
TOLERANCE = {"fp32": 1e-4, "bf16": 4 * 2**-8, "int8": 4 * 2**-8, "w8a8": 4 * 2**-8}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "w8a8"])
@pytest.mark.parametrize("family", ["gemma3", "llama", "qwen3"])
def test_prefix_and_blend_at_one_generate_like_full(engine_at, family: str, precision: str) -> None:
    e = engine_at(family, precision)
    req = _request(2)
    full = e.generate(req, "full", params=GREEDY)
    for mode, ratio in (("prefix", None), ("prefix", None), ("blend", 1.0), ("queryaware", 1.0)):
        e.precompute(req, mode)
        out = e.generate(req, mode, ratio, GREEDY)
        assert out.tokens == full.tokens, mode
        diff = (out.first_logits - full.first_logits).abs().max() / full.first_logits.abs().max().clamp_min(1.0)
        assert diff <= TOLERANCE[precision], f"{mode}: first-token logits differ by {diff:.2e}"


def test_token_accounting(tiny_engines) -> None:
    e = tiny_engines["gemma3"]
    req = _request(3)
    assert e.generate(req, "full", params=GREEDY).counts.as_dict() == {
        "prompt": 71, "prefilled": 71, "reused": 0, "recomputed": 0, "cached": 0}
    e.precompute(req, "prefix")
    c = e.generate(req, "prefix", params=GREEDY).counts
    # 4 full blocks and the 2-token tail of the 66 tokens before the question (`CacheManager.tail_key`)
    assert (c.prompt, c.reused, c.prefilled, c.cached) == (71, 66, 5, 66)
    cold = Request(prefix=req.prefix, chunks=tuple(rand_ids(10, 90 + i) for i in range(3)), suffix=req.suffix)
    c = e.generate(cold, "blend", 0.5, GREEDY).counts  # chunks computed on a miss are reused, not cached
    assert c.reused == 16 + 30 and c.cached == 16
    e.precompute(req, "blend")
    c = e.generate(req, "blend", 0.5, GREEDY).counts
    assert c.reused == 16 + 46 and c.prefilled == 71 - 62  # one cached head block + every chunk token
    sched = fuse.keep_schedule(e.cfg.num_layers, 46, 0.5)
    assert c.recomputed == round(sum(sched) / e.cfg.num_layers)
    assert c.cached == c.reused - c.recomputed  # every chunk was a hit


def test_precompute_then_hit(tiny_engines) -> None:
    e = tiny_engines["qwen2"]
    req = _request(4)
    assert e.precompute(req, "blend") > 0
    hits = e.store.stats.hits
    e.prefill(req, "blend", 0.15)
    assert e.store.stats.hits >= hits + 3  # every chunk (and the head block) came from the store


def test_chunks_in_any_order_and_duplicates(tiny_engines) -> None:
    e = tiny_engines["llama"]
    a, b = rand_ids(12, 50), rand_ids(17, 51)
    head, q = (1,) + rand_ids(3, 52), rand_ids(4, 53)
    for chunks in ((a, b), (b, a), (a, a, b)):
        req = Request(prefix=head, chunks=chunks, suffix=q)
        full = e.prefill(req, "full").fused.logits
        blended = e.prefill(req, "blend", 1.0).fused.logits
        assert float((blended - full).abs().max()) < 1e-4


def test_sampling_is_seeded_and_top_p_limits_choices() -> None:
    logits = torch.tensor([5.0, 4.9, 0.0, -1.0])
    p = SamplingParams(temperature=1.0, top_p=0.5, seed=0)
    picks = {sample(logits, p, torch.Generator().manual_seed(s)) for s in range(200)}
    assert picks == {0}  # token 0 alone holds half the mass
    p2 = SamplingParams(temperature=1.0, top_p=0.9)
    picks = {sample(logits, p2, torch.Generator().manual_seed(s)) for s in range(200)}
    assert picks == {0, 1}
    assert sample(logits, SamplingParams()) == 0


def test_seeded_generation_repeats(tiny_engines) -> None:
    e = tiny_engines["gemma3"]
    p = SamplingParams(max_tokens=8, temperature=1.2, top_p=0.95, seed=7, ignore_eos=True)
    req = _request(5)
    assert e.generate(req, "full", params=p).tokens == e.generate(req, "full", params=p).tokens
    # the seed is what decides: other seeds give other samples (8 tokens at temperature 1.2 over a random model)
    others = {tuple(e.generate(req, "full", params=replace(p, seed=s)).tokens) for s in range(4)}
    assert len(others) >= 3


def test_stop_tokens_end_generation(tiny_engines) -> None:
    e = tiny_engines["gemma3"]
    req = _request(6)
    toks = e.generate(req, "full", params=GREEDY).tokens
    stop_at = toks[3]
    out = e.generate(req, "full", params=SamplingParams(max_tokens=10, stop_token_ids=(stop_at,)))
    assert out.finish_reason == "stop" and out.tokens == toks[: toks.index(stop_at)]
    assert e.generate(req, "full", params=GREEDY).finish_reason == "length"


def test_stream_yields_tokens_and_records_ttft(tiny_engines) -> None:
    e = tiny_engines["gemma3"]
    stream = e.stream(_request(7), "full", None, GREEDY)
    first = next(stream)
    stream.close()  # a client that goes away cancels the rest
    assert stream.result is not None and stream.result.tokens[0] == first
    assert 0 < stream.result.ttft_s <= stream.result.total_s
    top = stream.result.first_token_top(20)
    assert len(top) == 20 and top[0][0] == first and all(a[1] >= b[1] for a, b in zip(top, top[1:], strict=False))


def test_bad_requests_get_clear_errors(tiny_engines) -> None:
    e = tiny_engines["llama"]
    with pytest.raises(RequestError, match="unknown mode 'fast'"):
        e.prefill(_request(), "fast")
    with pytest.raises(RequestError, match="ratio must be a number between 0 and 1"):
        e.prefill(_request(), "blend", 1.5)
    with pytest.raises(RequestError, match="context window is 512"):
        e.prefill(Request(prefix=(1,) * 600, suffix=(5,)), "full")
    with pytest.raises(RequestError, match="non-empty suffix"):
        e.prefill(Request(prefix=(1, 2), suffix=()), "full")
    with pytest.raises(RequestError, match="outside the vocabulary"):
        e.prefill(Request(suffix=(500,)), "full")
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_failed_self_check_refuses_reuse_and_blend(tiny_models) -> None:
    root, _ = tiny_models["gemma3"]
    lm = load_model(root)
    broken = lambda out, k, a, b, d, spec: out.copy_(k)  # noqa: E731 - "forgets" to re-rotate moved keys
    e = Engine(lm.model, lm.fingerprint, rotate=broken)
    assert e.blend_error and "self-check failed" in e.blend_error
    for mode in ("reuse", "blend"):
        with pytest.raises(ModeUnavailableError, match="use 'full' or 'prefix'"):
            e.prefill(_request(), mode)
    e.prefill(_request(), "prefix")  # the exact modes still work


def test_self_check_catches_a_blend_that_is_not_exact(tiny_models, monkeypatch) -> None:
    root, _ = tiny_models["llama"]
    lm = load_model(root)
    real = fuse.blend

    def off_by_a_bit(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        return replace(out, hidden=out.hidden + 0.5)

    monkeypatch.setattr(fuse, "blend", off_by_a_bit)
    e = Engine(lm.model, lm.fingerprint)
    assert e.blend_error and "blend at ratio 1.0 differs from full" in e.blend_error


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_legolink_bounds(tiny_engines, family: str) -> None:
    """Recomputing every chunk token (K >= the longest chunk) is full prefill; K = 0 is plain reuse."""
    e = tiny_engines[family]
    req = _request(7)
    e.precompute(req, "legolink")
    full = e.generate(req, "full", params=GREEDY)
    whole = e.generate(req, fuse.Legolink(head_tokens=max(len(c) for c in req.chunks)), params=GREEDY)
    none = e.generate(req, fuse.Legolink(head_tokens=0), params=GREEDY)
    reuse = e.generate(req, "reuse", params=GREEDY)
    assert (whole.first_logits - full.first_logits).abs().max() < 1e-4
    assert whole.counts.recomputed == sum(len(c) for c in req.chunks)
    assert torch.allclose(none.first_logits, reuse.first_logits, atol=1e-5)
    some = e.generate(req, fuse.Legolink(head_tokens=4), params=GREEDY)
    assert some.counts.recomputed == 4 * len(req.chunks)
    assert (some.first_logits - full.first_logits).abs().max() > 1e-4  # a partial recompute is not exact


def test_scored_logits_are_teacher_forced(tiny_engines) -> None:
    """Scoring the full-mode greedy answer reproduces the logits that generated it, step for step."""
    e = tiny_engines["qwen3"]
    req = _request(8)
    full = e.generate(req, "full", params=GREEDY, record_logits=True)
    assert full.step_logits is not None and full.step_logits.shape[0] == len(full.tokens)
    again = e.generate(req, "full", params=SamplingParams(max_tokens=1, ignore_eos=True), score=full.tokens)
    assert again.scored_logits is not None
    assert (again.scored_logits - full.step_logits).abs().max() < 1e-4
    assert [int(t) for t in again.scored_logits.argmax(-1)] == full.tokens


def test_sampling_survives_extreme_parameters() -> None:
    logits = torch.randn(50)
    for top_p in (1e-300, 1e-40, 1e-7):  # below float32's range, and tiny: the top token is always kept
        assert sample(logits, SamplingParams(temperature=1.0, top_p=top_p)) == int(logits.argmax())
    assert sample(logits, SamplingParams(temperature=1e-300)) == int(logits.argmax())


@pytest.mark.parametrize("mode", ["full", "blend"])
def test_decoding_in_the_prefill_buffers_equals_decoding_a_copy(tiny_engines, mode: str) -> None:
    from kvfuse.engine.decode import Slot, step_hidden

    e = tiny_engines["gemma3"]  # sliding and global layers
    req = _request(6)
    e.precompute(req, mode)
    with torch.inference_mode():
        pre = e.prefill(req, mode, 0.5 if mode == "blend" else None, room=6)
        assert pre.fused.buffers is not None and pre.fused.buffers[0].shape[2] == len(req) + 6
        prompt_k = pre.fused.cache.k.clone()
        in_place = Slot(e.model, pre.fused.cache, 6, pre.fused.buffers)
        copied = Slot(e.model, pre.fused.cache.clone(), 6)
        assert in_place.k.data_ptr() == pre.fused.buffers[0].data_ptr()  # no copy was made
        for t in rand_ids(6, 60):
            assert torch.equal(step_hidden(e.model, [in_place], [t]), step_hidden(e.model, [copied], [t]))
        assert in_place.room == 0
        with pytest.raises(ValueError, match="no room"):
            step_hidden(e.model, [in_place], [1])
        assert torch.equal(pre.fused.cache.k, prompt_k)  # the prompt's cache (written back later) is intact
        short = Slot(e.model, pre.fused.cache, 7, pre.fused.buffers)  # too little room: copies
        assert short.k.data_ptr() != pre.fused.buffers[0].data_ptr() and short.k.shape[2] == len(req) + 7


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_query_aware_is_a_mode_like_the_others(tiny_engines, family: str) -> None:
    """A fuser added to the registry is reachable by name through the engine and as an eval spec."""
    from kvfuse.eval.methods import parse_methods

    e = tiny_engines[family]
    req = _request(8)
    e.precompute(req, "queryaware")
    full = e.generate(req, "full", params=GREEDY)
    whole = e.generate(req, "queryaware", 1.0, params=GREEDY)
    some = e.generate(req, "queryaware", 0.3, params=GREEDY)
    n, layers = sum(len(c) for c in req.chunks), e.cfg.num_layers
    assert (whole.first_logits - full.first_logits).abs().max() < 1e-4 and whole.counts.recomputed == n
    assert some.counts.recomputed == math.ceil(0.3 * n) and some.ratio == 0.3 and some.mode == "queryaware"
    from kvfuse.fuse import QueryAware

    e.precompute(req, QueryAware(skip=2))
    later = e.generate(req, QueryAware(skip=2), 0.3, params=GREEDY)  # recomputed: token-layers over the layers
    assert later.counts.recomputed == round(math.ceil(0.3 * n) * (layers - 2) / layers) and later.fuser.endswith(
        ":skip=2")
    assert [m.name for m in parse_methods("queryaware@0.15,queryaware@1")] == ["queryaware@0.15", "queryaware@1.0"]


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_chunks_behind_the_request_head(tiny_engines, family: str) -> None:
    """behind=head computes the chunk caches behind the request's head: separate store entries (the head is
    part of the key), a different reuse cache, and at ratio 1.0 still exactly full prefill."""
    from kvfuse.fuse import QueryAware, Reuse

    e = tiny_engines[family]
    req = _request(8)
    head = QueryAware(behind="head")
    assert e.cache.chunk_preambles(head, req) == (tuple(req.prefix),) * 3 and req.prefix != e.preamble
    e.precompute(req, "reuse")
    bos_keys = {e.cache.chunk_key(c, req.chunk_salt) for c in req.chunks}
    head_keys = {e.cache.chunk_key(c, req.chunk_salt, req.prefix) for c in req.chunks}
    assert not bos_keys & head_keys and all(k in e.store for k in bos_keys)
    assert not any(k in e.store for k in head_keys)
    e.precompute(req, head)
    assert all(k in e.store for k in head_keys)
    full = e.generate(req, "full", params=GREEDY)
    whole = e.generate(req, head, 1.0, params=GREEDY)
    assert (whole.first_logits - full.first_logits).abs().max() < 1e-4 and whole.counts.cached > 0
    plain = e.generate(req, "reuse", params=GREEDY)
    behind = e.generate(req, Reuse(behind="head"), params=GREEDY)
    assert not torch.allclose(plain.first_logits, behind.first_logits)
    other = replace(req, prefix=req.prefix[:1] + tuple(reversed(req.prefix[1:])))
    assert e.cache.chunk_key(req.chunks[0], None, e.cache.chunk_preambles(head, other)[0]) not in head_keys


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_chunks_behind_their_neighbour(tiny_engines, family: str) -> None:
    """behind=previous computes each chunk behind BOS and the tokens just before it in this request; the
    same chunk after another neighbour is another entry; at ratio 1.0 it is still full prefill."""
    from kvfuse.fuse import NEIGHBOUR_TOKENS, QueryAware

    e = tiny_engines[family]
    req = _request(9)
    prev = QueryAware(behind="previous")
    pre = e.cache.chunk_preambles(prev, req)
    bos = e.preamble
    assert pre[0] == bos + tuple(req.prefix[1:])[-NEIGHBOUR_TOKENS:]
    assert pre[1] == bos + tuple(req.chunks[0])[-NEIGHBOUR_TOKENS:] and pre[2] == bos + tuple(req.chunks[1])
    e.precompute(req, prev)
    full = e.generate(req, "full", params=GREEDY)
    whole = e.generate(req, prev, 1.0, params=GREEDY)
    assert (whole.first_logits - full.first_logits).abs().max() < 1e-4 and whole.counts.cached > 0
    swapped = replace(req, chunks=(req.chunks[1], req.chunks[0], req.chunks[2]))
    assert e.cache.chunk_preambles(prev, swapped)[1] != pre[0]
    assert all(e.cache.chunk_key(c, None, p) in e.store for c, p in zip(req.chunks, pre, strict=True))
    assert e.cache.chunk_key(swapped.chunks[1], None, e.cache.chunk_preambles(prev, swapped)[1]) not in e.store


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_chunks_behind_a_copy_of_themselves(tiny_engines, family: str) -> None:
    """behind=self computes each chunk behind BOS and its own tokens repeated: the key depends on the chunk
    alone (the same entry in any order), and at ratio 1.0 it is still full prefill."""
    from kvfuse.fuse import NEIGHBOUR_TOKENS, QueryAware

    e = tiny_engines[family]
    req = _request(10)
    me = QueryAware(behind="self")
    pre = e.cache.chunk_preambles(me, req)
    for c, p in zip(req.chunks, pre, strict=True):
        assert len(p) == len(e.preamble) + NEIGHBOUR_TOKENS and p[: len(e.preamble)] == e.preamble
        assert p[-len(c):] == tuple(c) and p[-2 * len(c) : -len(c)] == tuple(c)
    swapped = replace(req, chunks=(req.chunks[2], req.chunks[0], req.chunks[1]))
    assert e.cache.chunk_preambles(me, swapped) == (pre[2], pre[0], pre[1])
    e.precompute(req, me)
    full = e.generate(req, "full", params=GREEDY)
    whole = e.generate(req, me, 1.0, params=GREEDY)
    assert (whole.first_logits - full.first_logits).abs().max() < 1e-4
    g = e.generate(swapped, me, 0.3, params=GREEDY)
    assert g.counts.cached == g.counts.reused - g.counts.recomputed  # every chunk came from the store


@pytest.mark.parametrize("mode", ["full", "prefix", "blend", "queryaware"])
def test_a_paused_prefill_decodes_exactly_as_a_quiet_one(tiny_engines, mode: str) -> None:
    """`begin(pause=...)` calls the pause between pieces of the prefill (the server steps other requests
    there), chunk computation on a miss included, and changes no token, logit or count."""
    e = tiny_engines["gemma3"]
    other = e.begin(_request(40), "full", params=GREEDY)
    pauses = {"n": 0}

    def step_another() -> None:
        pauses["n"] += 1
        if not other.done:
            e.advance([other])

    outs, kept = [], e.store
    try:
        for pause in (fuse.no_pause, step_another):
            e.store = TieredStore()  # a cold store each time: the chunks are computed inside the prefill
            d = e.begin(_request(41), mode, params=GREEDY, pause=pause)
            while not d.done:
                e.advance([d])
            outs.append(d.close())
    finally:
        e.store = kept
    quiet, paused = outs
    assert pauses["n"] >= e.cfg.num_layers - 1 and len(other.tokens) > 1
    assert paused.tokens == quiet.tokens and torch.equal(paused.first_logits, quiet.first_logits)
    assert paused.counts == quiet.counts


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3),
                                    SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.7, seed=2,
                                                   logprobs=5, logit_bias=((4, 3.0),), frequency_penalty=0.5),
                                    SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.3, seed=1,
                                                   logprobs=0)])
def test_logprobs_are_the_distribution_each_token_was_drawn_from(tiny_engines, params: SamplingParams) -> None:
    """Each token's logprob (and its alternatives, most likely first) is log_softmax of the recorded logits
    after logit_bias and the penalties, over the temperature (greedy: 1); asking for them changes no
    token, and the alternatives hold the chosen token where it is among the most likely."""
    from kvfuse.engine.sampling import adjusted

    e = tiny_engines["gemma3"]
    req = _request(5)
    plain = e.generate(req, "full", params=replace(params, logprobs=None))
    g = e.generate(req, "full", params=params)
    oracle = e.generate(req, "full", params=replace(params, logprobs=None), record_logits=True)
    assert g.tokens == plain.tokens == oracle.tokens and plain.logprobs is None
    assert g.logprobs is not None and [x.token for x in g.logprobs] == g.tokens
    t = params.temperature or 1.0
    for i, (x, logits) in enumerate(zip(g.logprobs, oracle.step_logits, strict=True)):
        lp = torch.log_softmax(adjusted(logits, params, g.tokens[:i]) / t, -1)
        assert x.logprob == pytest.approx(float(lp[x.token]), abs=1e-5)
        top = torch.topk(lp, params.logprobs or 0)
        assert [tok for tok, _ in x.top] == top.indices.tolist() and len(x.top) == params.logprobs
        assert [v for _, v in x.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


class _Allow:
    """A toy grammar over ids: step i allows only `steps[i]`; finished after the last step."""

    def __init__(self, steps: list[set[int]]) -> None:
        self.steps, self.at = steps, 0

    def allowed(self, vocab: int) -> torch.Tensor:
        return self._mask(self.at, vocab)

    def advance(self, token: int) -> None:
        assert token in self.steps[self.at], (token, self.steps[self.at])
        self.at += 1

    def finished(self) -> bool:
        return self.at == len(self.steps)

    def lookahead(self, tokens: Sequence[int], vocab: int) -> list[torch.Tensor]:
        masks, at = [self.allowed(vocab)], self.at
        for t in tokens:
            if t not in self.steps[at] or at + 1 == len(self.steps):
                break
            at += 1
            masks.append(self._mask(at, vocab))
        return masks

    def _mask(self, at: int, vocab: int) -> torch.Tensor:
        out = torch.zeros(vocab, dtype=torch.bool)
        out[list(self.steps[at])] = True
        return out


@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0])
def test_a_constraint_masks_every_token_and_ends_the_answer(tiny_engines, temperature: float) -> None:
    """Issue N.3's grammar mask, over token ids: greedy takes the best allowed token (the argmax of the
    masked recorded logits), sampling never leaves the mask, logprobs name only allowed alternatives,
    and the answer stops (finish "stop") when the grammar is complete; batched beside a plain request."""
    e = tiny_engines["gemma3"]
    steps = [{3, 5, 8}, {9}, {2, 4}, {6, 7, 10, 11}]
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=3, ignore_eos=True, logprobs=4)
    req = _request(7)
    d = e.begin(req, "full", None, params, constraint=_Allow(steps), record_logits=temperature == 0.0)
    other = e.begin(req, "full", None, SamplingParams(max_tokens=10, ignore_eos=True))
    while not (d.done and other.done):
        e.advance([d, other])
    g = d.close()
    assert len(g.tokens) == len(steps) and g.finish_reason == "stop"
    assert all(t in allowed for t, allowed in zip(g.tokens, steps, strict=True))
    assert g.logprobs is not None and all({a for a, _ in x.top} <= allowed and len(x.top) == min(4, len(allowed))
                                          for x, allowed in zip(g.logprobs, steps, strict=True))
    if temperature == 0.0:  # the best allowed token of the recorded (masked) logits
        assert g.step_logits is not None
        assert g.tokens == [int(row.argmax()) for row in g.step_logits[: len(steps)]]
        # and the same tokens where the screen picks them among the allowed ones (nothing recorded)
        screened = e.generate(req, "full", params=replace(params, logprobs=None), constraint=_Allow(steps))
        assert screened.tokens == g.tokens
    assert other.close().tokens == e.generate(req, "full", params=SamplingParams(max_tokens=10,
                                                                                  ignore_eos=True)).tokens


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_a_prefix_tail_is_read_from_the_store_and_answers_as_full(tiny_engines, family: str) -> None:
    """A prefix that ends inside a block: its tail is stored under its own key (by `precompute`, or by the
    first request that computes it) and read with the blocks, so the question alone is computed, with
    the tokens a full prefill gives; another tail after the same blocks is not a hit."""
    e: Engine = tiny_engines[family]
    prefix = (1,) + rand_ids(44, 21)  # 2 full blocks and a 13-token tail
    req = Request(prefix=prefix, chunks=(), suffix=rand_ids(6, 22))
    full = e.generate(req, "full", params=GREEDY)
    first = e.generate(req, "prefix", params=GREEDY)  # computes everything, then stores the blocks and tail
    again = e.generate(req, "prefix", params=GREEDY)
    assert (first.counts.cached, again.counts.cached, again.counts.prefilled) == (0, 45, 6)
    assert first.tokens == again.tokens == full.tokens
    diff = (again.first_logits - full.first_logits).abs().max() / full.first_logits.abs().max().clamp_min(1.0)
    assert diff <= 1e-4
    other = Request(prefix=prefix[:-1] + (prefix[-1] % 100 + 3,), chunks=(), suffix=req.suffix)
    e.precompute(other, "prefix")  # its own tail, stored ahead of the request
    got = e.generate(other, "prefix", params=GREEDY)
    assert got.counts.cached == 45 and got.tokens == e.generate(other, "full", params=GREEDY).tokens
