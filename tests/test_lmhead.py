import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfuse import w8a8
from kvfuse.engine.lmhead import SCREENS, GreedyHead

KERNELS = [k if k != "w8a8" or w8a8.available() else pytest.param(k, marks=pytest.mark.skip("no FBGEMM"))
           for k in SCREENS]


@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(2, 700), hidden=st.sampled_from([16, 32, 64, 640]), seed=st.integers(0, 2**16),
       x_scale=st.sampled_from([0.01, 1.0, 300.0]), outlier=st.sampled_from([1.0, 15.0]))
def test_screened_argmax_is_the_float32_argmax(kernel: str, vocab: int, hidden: int, seed: int, x_scale: float,
                                               outlier: float) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) * torch.rand(vocab, 1, generator=g)  # rows of unequal size
    head = GreedyHead(w, kernel)
    for _ in range(5):
        x = torch.randn(hidden, generator=g) * x_scale
        x[0] *= outlier  # a channel far above the others, as Gemma's normed hidden states have
        exact = F.linear(x[None], w)[0]
        cand = head.candidates(x)
        assert int(exact.argmax()) in cand.tolist()
        assert head.argmax(x) == int(exact.argmax())
    xs = torch.randn(4, hidden, generator=g) * x_scale  # several rows share one screen
    assert head.argmax_rows(xs) == [int(r.argmax()) for r in F.linear(xs, w)]


@pytest.mark.parametrize("hidden", [12, 24, 33, 40])
def test_a_head_whose_width_is_not_a_multiple_of_16_is_screened_too(hidden: int) -> None:
    """torch's AVX-512 int8 kernel reads past rows of such widths (a segfault, stop 52): the int8pack
    screen reads them in float32 instead, and still finds the float32 argmax."""
    g = torch.Generator().manual_seed(hidden)
    for vocab in range(2, 400, 37):
        w = torch.randn(vocab, hidden, generator=g)
        head = GreedyHead(w, "int8pack")
        xs = torch.randn(6, hidden, generator=g)
        assert head.argmax_rows(xs) == [int(r.argmax()) for r in F.linear(xs, w)]


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_screen_reads_few_rows_and_settles_near_ties(kernel: str) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(5000, 64, generator=g)
    x = torch.randn(64, generator=g) * 4
    head = GreedyHead(w, kernel)
    assert head.kernel == kernel
    assert len(head.candidates(x)) < 100  # it screens: most of the vocabulary is ruled out
    best = int(F.linear(x[None], w)[0].argmax())
    w2 = torch.cat([w, w[best : best + 1] * (1 - 3e-6)])  # a near-copy of the winner, just below it
    w2[best] *= 1 + 3e-6
    assert GreedyHead(w2, kernel).argmax(x) == int(F.linear(x[None], w2)[0].argmax()) == best


def test_the_screen_prefers_fbgemm_where_it_exists(monkeypatch) -> None:
    from kvfuse.engine import lmhead

    w = torch.randn(300, 64)
    assert GreedyHead.build(w).kernel == ("w8a8" if w8a8.available() else "int8pack")  # type: ignore[union-attr]
    monkeypatch.setattr(w8a8, "available", lambda: False)
    assert lmhead.default_screen() == "int8pack"
    with pytest.raises(ValueError, match="unknown screen kernel"):
        GreedyHead(w, "fp8")


def test_without_the_kernel_decoding_keeps_the_float32_head(tiny_engines, monkeypatch) -> None:
    from kvfuse.engine import Engine
    from kvfuse.engine.sampling import SamplingParams

    e = tiny_engines["gemma3"]
    screened = Engine(e.model, e.fingerprint, self_check=False)
    plain = Engine(e.model, e.fingerprint, self_check=False, greedy_screen=False)
    assert screened.greedy_head() is not None and plain.greedy_head() is None
    monkeypatch.delattr(torch, "_weight_int8pack_mm")
    monkeypatch.setattr(w8a8, "available", lambda: False)
    assert GreedyHead.build(e.model.head_weight()) is None
    gone = Engine(e.model, e.fingerprint, self_check=False)
    assert gone.greedy_head() is None
    from kvfuse.engine import Request

    req = Request(prefix=(1, 5, 9, 33), suffix=(7, 8, 21))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = plain.generate(req, "full", params=params).tokens
    assert gone.generate(req, "full", params=params).tokens == want


@pytest.mark.parametrize("family", ["gemma3", "llama", "qwen3"])
def test_screened_greedy_generation_equals_plain(tiny_engines, family: str) -> None:
    from kvfuse.engine import Engine, Request
    from kvfuse.engine.sampling import SamplingParams

    e = tiny_engines[family]
    plain = Engine(e.model, e.fingerprint, self_check=False, greedy_screen=False)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for seed in range(3):
        ids = tuple(int(t) for t in torch.randint(2, 128, (20,), generator=torch.Generator().manual_seed(seed)))
        req = Request(prefix=ids[:15], suffix=ids[15:])
        assert e.greedy_head() is not None
        assert e.generate(req, "full", params=params).tokens == plain.generate(req, "full", params=params).tokens


@pytest.mark.parametrize("mode", ["full", "reuse", "queryaware"])
def test_a_greedy_first_token_reads_no_float_head_until_its_logits_are_asked_for(tiny_engines, monkeypatch,
                                                                                    mode: str) -> None:
    """The first token of a greedy request comes from the screen; `first_logits` is computed on demand
    and its argmax is that token (the plain path's choice)."""
    from kvfuse.engine import Engine, Request
    from kvfuse.engine.sampling import SamplingParams

    e = tiny_engines["llama"]
    plain = Engine(e.model, e.fingerprint, self_check=False, greedy_screen=False)
    assert e.greedy_head() is not None  # built (Engine.load builds it); never inside a request's TTFT
    ids = tuple(int(t) for t in torch.randint(2, 128, (40,), generator=torch.Generator().manual_seed(7)))
    req = Request(prefix=ids[:10], chunks=(ids[10:22], ids[22:35]), suffix=ids[35:])
    want = plain.generate(req, mode, params=SamplingParams(max_tokens=1))
    calls: list[int] = []
    real = type(e.model).logits
    monkeypatch.setattr(type(e.model), "logits", lambda self, h: calls.append(h.shape[0]) or real(self, h))
    got = e.generate(req, mode, params=SamplingParams(max_tokens=1))
    assert got.tokens == want.tokens and calls == []  # chosen by the screen: the float head was not read
    assert int(got.first_logits.argmax()) == got.tokens[0] and calls == [1]
    assert torch.allclose(got.first_logits, want.first_logits, atol=1e-5) and calls == [1]  # computed once
    sampled = e.generate(req, mode, params=SamplingParams(max_tokens=1, temperature=0.8, seed=1))
    assert len(sampled.tokens) == 1 and len(calls) == 2  # sampling needs the logits themselves


def test_a_fresh_engine_builds_no_screen_inside_a_one_token_request(tiny_models, monkeypatch) -> None:
    """Building the screen takes seconds on a real model: a request never pays for it in its TTFT (its first
    token reads the float head until the screen exists); decoding steps build it."""
    from kvfuse.engine import Engine, Request
    from kvfuse.engine.sampling import SamplingParams
    from kvfuse.weights import load_model

    built: list[int] = []
    real = GreedyHead.build
    monkeypatch.setattr(GreedyHead, "build", staticmethod(lambda w, kernel=None: built.append(1) or real(w, kernel)))
    lm = load_model(tiny_models["llama"][0])
    e = Engine(lm.model, lm.fingerprint, self_check=False)
    req = Request(prefix=(1, 5, 9, 13, 17), suffix=(21, 25))
    one = e.generate(req, "full", params=SamplingParams(max_tokens=1))
    assert built == [] and one.tokens == [int(one.first_logits.argmax())]
    more = e.generate(req, "full", params=SamplingParams(max_tokens=3, ignore_eos=True))
    assert built == [1] and more.tokens[0] == one.tokens[0]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("temperature", "softcap", "bias"), [(0.5, None, False), (0.3, None, True),
                                                            (0.4, 3.0, True)])
def test_screened_sampling_draws_the_float32_distribution(kernel: str, temperature: float, softcap: float | None,
                                                          bias: bool, monkeypatch) -> None:
    """Sampling through the screen draws exactly softmax((cap(l) + adjustments) / T): near tokens exactly,
    far ones proposed from their bounds and kept by the rejection rule. The empirical frequencies of
    6,000 draws sit within sampling noise of the exact probabilities, with NEAR as it is and with NEAR
    small (far tokens proposed and rejected far more often: the same distribution); where the far
    bounds could weigh too much, or too many tokens are near, it declines before drawing."""
    from kvfuse.engine import lmhead
    from kvfuse.engine.sampling import SamplingParams, adjusted

    g = torch.Generator().manual_seed(3)
    vocab, hidden = 300, 64
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    x = torch.randn(hidden, generator=g)
    w[:6] += x * torch.tensor([0.12, 0.11, 0.1, 0.1, 0.09, 0.08])[:, None]  # a few tokens well above the rest
    head = GreedyHead(w, kernel)
    params = SamplingParams(temperature=temperature, logit_bias=((3, 1.0), (7, 3.0)) if bias else (),
                            frequency_penalty=0.5 if bias else 0.0)
    generated = [1, 1, 2] if bias else []
    raw = F.linear(x[None], w)[0]
    logits = raw if softcap is None else torch.tanh(raw / softcap) * softcap
    want = torch.softmax(adjusted(logits, params, generated) / temperature, dim=-1).double()
    approx, slack = (t[0] for t in head.bounds_rows(x[None]))
    assert bool((raw - approx).abs().le(slack).all())
    for near in (lmhead.NEAR, 2.0):
        monkeypatch.setattr(lmhead, "NEAR", near)
        monkeypatch.setattr(lmhead, "MAX_REST", 10.0)
        gen = torch.Generator().manual_seed(11)
        n = 6_000
        draws = [head.sample(x, (approx, slack), params, gen, generated, softcap) for _ in range(n)]
        assert None not in draws
        freq = torch.bincount(torch.tensor(draws), minlength=vocab).double() / n
        sigma = (want * (1 - want) / n).sqrt()
        assert bool(((freq - want).abs() <= 5 * sigma + 3 / n).all()), (near, (freq - want).abs().max())
    monkeypatch.setattr(lmhead, "MAX_REST", 1e-12)  # the far tokens' bounds weigh too much: the whole head
    assert head.sample(x, (approx, slack), params, gen, generated, softcap) is None
    monkeypatch.setattr(lmhead, "MAX_REST", 10.0)
    monkeypatch.setattr(lmhead, "MAX_NEAR", 0)  # too many near tokens: the whole head
    assert head.sample(x, (approx, slack), params, gen, generated, softcap) is None


@pytest.mark.parametrize(("temperature", "top_p", "screened"), [(0.3, 1.0, True), (0.8, 1.0, False),
                                                                 (0.3, 0.9, False)])
def test_sampled_steps_draw_through_the_screen_at_low_temperatures(tiny_engines, monkeypatch, temperature: float,
                                                                   top_p: float, screened: bool) -> None:
    """The scheduler draws a sampled request's tokens through the screen where it may (a temperature up
    to SAMPLE_MAX_T, no nucleus), and the seeded tokens repeat, alone and beside a greedy request."""
    from kvfuse.engine.sampling import SamplingParams
    from kvfuse.request import Request

    e = tiny_engines["gemma3"]
    calls: list[int] = []
    real = GreedyHead.sample

    def counted(self, *a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(GreedyHead, "sample", counted)
    req = Request(prefix=(1, 5, 9, 13, 17, 21), chunks=(), suffix=(3, 4))
    p = SamplingParams(max_tokens=10, temperature=temperature, top_p=top_p, seed=4, ignore_eos=True)
    alone = e.generate(req, "prefix", params=p).tokens
    assert bool(calls) is screened
    batch = [e.begin(req, "prefix", None, p), e.begin(req, "prefix", None, SamplingParams(max_tokens=10))]
    while not all(d.done for d in batch):
        e.advance(batch)
    assert batch[0].close().tokens == alone == e.generate(req, "prefix", params=p).tokens



@pytest.mark.parametrize("kernel", KERNELS)
def test_the_screen_finds_the_best_allowed_token(kernel: str) -> None:
    """A grammar's mask: the screened argmax among the allowed tokens is the float32 argmax of the
    masked logits, row by row, a row without a mask untouched."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3000, 64, generator=g)
    head = GreedyHead(w, kernel)
    xs = torch.randn(4, 64, generator=g) * 3
    exact = F.linear(xs, w)
    masks = [torch.rand(3000, generator=g) < share for share in (0.5, 0.01, 0.001)] + [None]
    got = head.argmax_rows(xs, allowed=masks)
    for row, m, tok in zip(exact, masks, got, strict=True):
        want = int(row.masked_fill(~m, float("-inf")).argmax()) if m is not None else int(row.argmax())
        assert tok == want and (m is None or bool(m[tok]))


@pytest.mark.skipif(not w8a8.available(), reason="no FBGEMM")
def test_the_fbgemm_screen_keeps_only_fbgemms_copy_of_the_int8_rows() -> None:
    """FBGEMM's packed rows replace the int8 rows: no tensor (nor a view of none) keeps the rows' bytes."""
    w = torch.randn(512, 64, generator=torch.Generator().manual_seed(3))
    head = GreedyHead(w, "w8a8")
    assert head.q.untyped_storage().nbytes() == 0
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    assert head.argmax_rows(x) == F.linear(x, w).argmax(1).tolist()
