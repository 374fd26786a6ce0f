import math

import pytest
import torch
from conftest import rand_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import FAMILIES

from kvfuse import fuse
from kvfuse.weights import load_model


def _t(ids) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.int64)


def _assert_close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    diff = (a - b).abs()
    scale = b.abs().max().clamp_min(1.0)
    assert float(diff.max() / scale) < tol, f"{what}: max diff {diff.max():.3e}, mean diff {diff.mean():.3e}"


@pytest.fixture(scope="module")
def models(tiny_models):  # type: ignore[no-untyped-def]
    return {f: load_model(tiny_models[f][0]).model for f in FAMILIES}


def _layout(seed: int = 0):  # type: ignore[no-untyped-def]
    # BOS, a short head, three chunks and a question; long enough to cross the tiny sliding windows
    prefix = (1,) + rand_ids(4, seed)
    chunks = [rand_ids(n, seed + i + 1) for i, n in enumerate((9, 14, 6))]
    suffix = rand_ids(5, seed + 9)
    return prefix, chunks, suffix


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_equals_full(models, family: str) -> None:
    m = models[family]
    ids = _t(rand_ids(40, 1))
    full = fuse.prefill(m, ids)
    for cut in (1, 16, 39):
        part = fuse.prefill(m, ids[cut:], past=fuse.prefill(m, ids[:cut]).cache)
        _assert_close(part.logits, full.logits, f"{family} prefix cut {cut} logits")
        _assert_close(part.cache.k, full.cache.k, f"{family} prefix cut {cut} keys")


@pytest.mark.parametrize("family", FAMILIES)
def test_blend_at_ratio_one_equals_full(models, family: str) -> None:
    m = models[family]
    prefix, chunks, suffix = _layout()
    full = fuse.prefill(m, _t(prefix + sum(chunks, ()) + suffix))
    caches = [fuse.precompute_chunk(m, (1,), c) for c in chunks]  # computed at offset 1, so re-rotated
    out = fuse.blend(m, _fused_layout(m, prefix, caches, chunks, suffix), 1.0)
    _assert_close(out.logits, full.logits, f"{family} blend@1 logits")
    _assert_close(out.cache.k, full.cache.k, f"{family} blend@1 keys")
    _assert_close(out.cache.v, full.cache.v, f"{family} blend@1 values")


@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_equals_block_diagonal_oracle(models, family: str) -> None:
    """Chunks precomputed at their final offsets (no re-rotation) match a full pass in which each
    chunk sees only the preamble and itself."""
    m = models[family]
    prefix, chunks, suffix = _layout(5)
    ids = _t(prefix + sum(chunks, ()) + suffix)
    n = len(ids)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    at, caches = len(prefix), []
    for c in chunks:
        mask[at : at + len(c), 1:at] = False  # a chunk sees the preamble (BOS at 0) and itself only
        caches.append(fuse.precompute_chunk(m, (1,), c, start=at))
        at += len(c)
    oracle = m(ids, mask=mask)
    out = fuse.reuse(m, fuse.FuseLayout.of(fuse.prefill(m, _t(prefix)).cache, caches, _t(suffix)))
    _assert_close(out.logits, oracle[-1], f"{family} reuse vs block-diagonal oracle")
    assert float((out.logits - fuse.prefill(m, ids).logits).abs().max()) > 1e-4  # reuse is not full


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 40), n=st.integers(0, 5000), ratio=st.floats(0.0, 1.0), m=st.integers(1, 6))
def test_keep_schedule_shrinks_to_ratio(layers: int, n: int, ratio: float, m: int) -> None:
    keep = fuse.keep_schedule(layers, n, ratio, m)
    assert len(keep) == layers and keep[0] == n
    assert all(a >= b for a, b in zip(keep, keep[1:], strict=False))
    if layers > m:
        assert keep[-1] == min(n, math.ceil(ratio * n - 1e-9))


def test_keep_schedule_rejects_bad_ratio() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        fuse.keep_schedule(4, 10, 1.5)


def test_blend_selection_only_shrinks_and_counts(models) -> None:
    m = models["qwen3"]
    prefix, chunks, suffix = _layout(3)
    caches = [fuse.precompute_chunk(m, (1,), c) for c in chunks]
    out = fuse.blend(m, _fused_layout(m, prefix, caches, chunks, suffix), 0.3)
    n = sum(len(c) for c in chunks)
    sizes = [len(s) for s in out.selected]
    assert sizes == fuse.keep_schedule(m.cfg.num_layers, n, 0.3)
    for a, b in zip(out.selected, out.selected[1:], strict=False):
        assert set(b.tolist()) <= set(a.tolist())
    assert out.recomputed_token_layers == sum(sizes)


def test_blend_picks_the_highest_deviation_tokens(models) -> None:
    """Make one chunk token's cached KV badly wrong: the first filtering layer must recompute it."""
    m = models["llama"]
    prefix, chunks, suffix = _layout(4)
    caches = [fuse.precompute_chunk(m, (1,), c) for c in chunks]
    caches[1].k[1, :, 3] += 50.0  # layer 1, chunk 1, token 3
    out = fuse.blend(m, _fused_layout(m, prefix, caches, chunks, suffix), 0.1)
    assert len(chunks[0]) + 3 in out.selected[1].tolist()


def test_kv_deviation_is_zero_for_identical_kv() -> None:
    k, v = torch.randn(2, 7, 8), torch.randn(2, 7, 8)
    assert torch.all(fuse.kv_deviation(k, v, k, v) == 0)
    k2 = k.clone()
    k2[:, 4] += 1
    assert int(fuse.kv_deviation(k2, v, k, v).argmax()) == 4


def _fused_layout(m, prefix, caches, chunks, suffix) -> fuse.FuseLayout:  # type: ignore[no-untyped-def]
    """prefix as an exact cache, then the chunk caches and their ids, then the suffix."""
    return fuse.FuseLayout.of(fuse.prefill(m, _t(prefix)).cache, caches, _t(suffix), [_t(c) for c in chunks])


def _fused_case(m, seed: int):  # type: ignore[no-untyped-def]
    """A layout's full prefill (the oracle) and its fused layout, chunks precomputed behind BOS."""
    prefix, chunks, suffix = _layout(seed)
    full = fuse.prefill(m, _t(prefix + sum(chunks, ()) + suffix))
    caches = [fuse.precompute_chunk(m, (1,), c) for c in chunks]
    return full, _fused_layout(m, prefix, caches, chunks, suffix), prefix, chunks


@pytest.mark.parametrize("family", FAMILIES)
def test_query_aware_bounds_and_selection(models, family: str) -> None:
    """queryaware@1.0 recomputes everything (full prefill); @0 is plain reuse; in between, the tokens
    recomputed on every layer are exactly the top ones by the suffix's attention over the reused cache."""
    m = models[family]
    full, layout, prefix, chunks = _fused_case(m, 4)
    _assert_close(fuse.query_aware(m, layout, 1.0).logits, full.logits, f"{family} queryaware@1", 1e-4)
    _assert_close(fuse.query_aware(m, layout, 0.0).logits, fuse.reuse(m, layout).logits, f"{family} @0", 1e-5)
    from kvfuse.fuse.queryaware import suffix_attention

    score, _ = suffix_attention(m, layout, "all")
    n = sum(len(c) for c in chunks)
    assert score.shape == (n,) and bool((score >= 0).all()) and float(score.sum()) > 0
    out = fuse.query_aware(m, layout, 0.3, layers="all")
    top = set(torch.topk(score, math.ceil(0.3 * n)).indices.tolist())
    assert all(set(sel.tolist()) == top for sel in out.selected)  # one set, on every layer
    glob, _ = suffix_attention(m, layout)  # the default: the global layers' attention
    by_default = fuse.query_aware(m, layout, 0.3)
    assert set(by_default.selected[0].tolist()) == set(torch.topk(glob, math.ceil(0.3 * n)).indices.tolist())
    windows = [m.cfg.window(i) for i in range(m.cfg.num_layers)]
    if any(windows) and not all(windows):  # only the full layers count
        assert not torch.allclose(glob, score)
    else:  # no sliding layers: every layer is global
        assert torch.allclose(glob, score)


@pytest.mark.parametrize("family", FAMILIES)
def test_query_aware_wide_narrows_by_deviation(models, family: str) -> None:
    """With wide > ratio the first layers recompute the wide share by attention; the later ones keep the
    ratio of those that deviate most (a subset); at ratio 1.0 it is still full prefill."""
    from kvfuse.fuse.queryaware import FILTER_LAYERS, suffix_attention

    m = models[family]
    full, layout, prefix, chunks = _fused_case(m, 5)
    n = sum(len(c) for c in chunks)
    out = fuse.query_aware(m, layout, 0.2, wide=0.6)
    score, _ = suffix_attention(m, layout)
    wide = set(torch.topk(score, math.ceil(0.6 * n)).indices.tolist())
    sizes = [len(sel) for sel in out.selected]
    assert sizes == [math.ceil(0.6 * n)] * FILTER_LAYERS + [math.ceil(0.2 * n)] * (m.cfg.num_layers - FILTER_LAYERS)
    assert set(out.selected[0].tolist()) == wide and set(out.selected[-1].tolist()) < wide
    narrow = fuse.query_aware(m, layout, 0.2)
    assert not torch.equal(out.logits, narrow.logits)  # the wide first layers changed something
    _assert_close(fuse.query_aware(m, layout, 1.0, wide=1.0).logits, full.logits, f"{family} wide@1", 1e-4)
    with pytest.raises(ValueError, match="wide"):
        fuse.QueryAware(wide=1.5)


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_pick_spends_at_most_its_share_of_work_on_the_best_tokens_per_unit(scores: list[float], share: float,
                                                                          seed: int) -> None:
    """Without work, `pick` is the top share of tokens by score. With work, it takes tokens in order of
    score per unit of work while the share of the total lasts: within budget, no chosen token is worth
    less per unit than one left out, and the best token left out would not have fitted."""
    from kvfuse.fuse.queryaware import pick

    score = torch.tensor(scores, dtype=torch.float64)
    n = score.shape[0]
    top = pick(score, share)
    assert top.shape[0] == min(n, math.ceil(share * n - 1e-9)) and bool((top[1:] > top[:-1]).all())
    out = torch.ones(n, dtype=torch.bool).index_fill(0, top, False)
    if top.shape[0] and bool(out.any()):
        assert float(score[top].min()) >= float(score[out].max())
    work = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.1
    chosen = pick(score, share, work)
    assert bool((chosen[1:] > chosen[:-1]).all())
    budget = share * float(work.sum())
    assert float(work[chosen].sum()) <= budget * (1 + 1e-9)
    left = torch.ones(n, dtype=torch.bool)
    left[chosen] = False
    if chosen.numel() and bool(left.any()):
        assert float((score[chosen] / work[chosen]).min()) >= float((score[left] / work[left]).max()) - 1e-12
    if bool(left.any()):
        density = torch.where(left, score / work, torch.tensor(-1.0, dtype=torch.float64))
        best = int(density.argmax())
        assert float(work[chosen].sum()) + float(work[best]) > budget * (1 + 1e-9)
    assert pick(score, share, torch.ones(n, dtype=torch.float64)).shape[0] == min(n, math.floor(share * n * (1 + 1e-9)))


@pytest.mark.parametrize("family", FAMILIES)
def test_recompute_work_grows_with_the_keys_a_token_sees(models, family: str) -> None:
    """A token's recompute work is the same matmuls at every position plus attention over the keys it
    sees: one more position adds one key on each full-attention layer, and nothing on a sliding layer
    past its window."""
    from kvfuse.fuse.queryaware import recompute_work

    cfg = models[family].cfg
    pos = torch.arange(0, 40)
    work = recompute_work(cfg, pos)
    per_key = 2 * cfg.num_heads * cfg.head_dim
    windows = [cfg.window(i) for i in range(cfg.num_layers)]
    far = max(w or 0 for w in windows)
    step = work[1:] - work[:-1]
    full_layers = sum(w is None for w in windows)
    assert torch.equal(step[far:], torch.full_like(step[far:], per_key * full_layers))
    assert bool((step >= 0).all()) and float(work[0]) > 0
    assert float(work[0]) == cfg.num_layers * (per_key + cfg.hidden_size * cfg.head_dim * (
        2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * cfg.hidden_size * cfg.intermediate_size)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_query_aware_by_work_spends_its_share_of_work(models, family: str) -> None:
    """`cost=work`: the fixed set recomputed on every layer is `pick` by score per unit of work, within
    the ratio's share of the chunk tokens' work; it differs from the top tokens by score where late
    tokens score high; at ratio 1.0 it is still full prefill."""
    from kvfuse.fuse.core import IN_PLACE
    from kvfuse.fuse.queryaware import pick, recompute_work, suffix_attention

    m = models[family]
    full, layout, prefix, chunks = _fused_case(m, 7)
    n = sum(len(c) for c in chunks)
    score, _ = suffix_attention(m, layout)
    work = recompute_work(m.cfg, torch.arange(len(prefix), len(prefix) + n))
    out = fuse.query_aware(m, layout, 0.3, cost="work")
    chosen = pick(score, 0.3, work)
    assert all(torch.equal(sel, chosen) for sel in out.selected)
    assert float(work[chosen].sum()) <= 0.3 * float(work.sum()) * (1 + 1e-9)
    late = score * torch.linspace(0.1, 10.0, n)  # scores that grow along the chunks: density prefers earlier
    assert not torch.equal(pick(late, 0.3, work), pick(late, 0.3))
    via_spec, r = fuse.parse_spec("queryaware@0.3:cost=work")
    assert r == 0.3 and torch.equal(via_spec.fuse(m, layout, r, IN_PLACE).logits, out.logits)
    _assert_close(fuse.query_aware(m, layout, 1.0, cost="work").logits, full.logits, f"{family} work@1", 1e-4)
    with pytest.raises(ValueError, match="cost must be"):
        fuse.QueryAware(cost="flops")


def test_fuser_specs_parse_and_print_back() -> None:
    """NAME@ARG:OPTION=VALUE names a fuser with its options; spec_of prints what parse_spec reads back."""
    for spec in ("blend@0.15", "queryaware@0.2:wide=0.4:behind=head", "legolink@8:behind=head", "reuse:behind=head",
                 "queryaware@auto:layers=all", "blend@0.3:filter_layers=4"):
        fuser, ratio = fuse.parse_spec(spec)
        again, r2 = fuse.parse_spec(fuse.spec_of(fuser, ratio))
        assert again == fuser and r2 == ratio
    qa, r = fuse.parse_spec("queryaware@0.2:wide=0.4:behind=head")
    assert qa == fuse.QueryAware(wide=0.4, behind="head") and r == 0.2
    assert fuse.spec_of(fuse.Legolink(8), None) == "legolink@8" and fuse.spec_of(fuse.Blend(), 0.15) == "blend@0.15"
    assert fuse.parse_fuser("queryaware:behind=head") == fuse.QueryAware(behind="head")
    for bad, msg in (("queryaware@0.2:colour=red", "unknown option"), ("blend@0.2:filter_layers=x", "needs a int"),
                     ("reuse:behind=tail", "behind must be"), ("nosuch@1", "unknown fuser"),
                     ("queryaware@0.2:layers=some", "layers must be"), ("reuse@3", "takes no")):
        with pytest.raises(ValueError, match=msg):
            fuse.parse_spec(bad)
    with pytest.raises(ValueError, match="without an @argument"):
        fuse.parse_fuser("blend@0.2")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pass_in_placed_buffers_equals_a_fresh_pass(models, family: str) -> None:
    """fuse_chunks over an earlier pass's buffers (chunk KV already re-rotated in place) gives exactly what
    a pass that reads and places the chunks itself gives, for a shrinking set and a fixed one."""
    m = models[family]
    prefix, chunks, suffix = _layout(6)
    caches = [fuse.precompute_chunk(m, (1,), c) for c in chunks]
    layout = _fused_layout(m, prefix, caches, chunks, suffix)
    n = sum(len(c) for c in chunks)
    fixed = torch.arange(0, n, 3)
    for keep, cand in ((fuse.keep_schedule(m.cfg.num_layers, n, 0.3), None), ([len(fixed)] * m.cfg.num_layers, fixed)):
        first = fuse.reuse(m, layout)
        fresh = fuse.fuse_chunks(m, layout, keep, candidates=cand)
        again = fuse.fuse_chunks(m, layout, keep, candidates=cand, resume=fuse.Resume((first.cache.k, first.cache.v)))
        assert torch.equal(fresh.logits, again.logits) and torch.equal(fresh.cache.k, again.cache.k)
    with pytest.raises(ValueError, match="cannot hold"):
        fuse.fuse_chunks(m, layout, keep, candidates=cand,
                         resume=fuse.Resume((first.cache.k[:, :, :5], first.cache.v[:, :, :5])))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefill_in_slices_equals_the_naive_forward(models, family: str, monkeypatch) -> None:
    """A prefill runs each layer in PREFILL_SLICE-row slices; slices of 7 rows (crossing the tiny sliding
    windows), after a past cache or not, give the naive forward's logits and one piece's KV."""
    m = models[family]
    ids = _t(rand_ids(40, 11))
    with torch.inference_mode():
        naive = m(ids)[-1]
        whole = fuse.prefill(m, ids)
        monkeypatch.setattr(fuse.core, "PREFILL_SLICE", 7)
        sliced = fuse.prefill(m, ids)
        tail = fuse.prefill(m, ids[9:], past=fuse.prefill(m, ids[:9]).cache)
    for what, got in (("sliced", sliced), ("sliced after a past", tail)):
        _assert_close(got.logits, naive, f"{family} {what} logits")
        _assert_close(got.cache.k, whole.cache.k, f"{family} {what} keys")
        _assert_close(got.cache.v, whole.cache.v, f"{family} {what} values")


@pytest.mark.parametrize("family", FAMILIES)
def test_pausing_changes_nothing_and_comes_between_pieces(models, family: str, monkeypatch) -> None:
    """Every builder calls its pause between pieces (each layer; each slice of a prefill's layer), and a
    pause that runs other model work meanwhile changes no bit of what is built."""
    m = models[family]
    monkeypatch.setattr(fuse.core, "PREFILL_SLICE", 8)
    prefix, chunks, suffix = _layout(3)
    ids = _t(prefix + sum(chunks, ()) + suffix)
    caches = [fuse.precompute_chunk(m, (1,), c) for c in chunks]
    layout = _fused_layout(m, prefix, caches, chunks, suffix)
    other = _t(rand_ids(30, 99))
    calls = {"n": 0}

    def busy() -> None:  # what the server does in a pause: other requests' model work
        calls["n"] += 1
        fuse.prefill(m, other)

    ctx = fuse.FuseContext(pause=busy)
    layers = m.cfg.num_layers

    def built(f: fuse.Fused) -> tuple[torch.Tensor, ...]:
        return f.logits, f.cache.k, f.cache.v

    builds = {  # name: (what it builds, as tensors), the pauses it makes
        "prefill": (lambda c: built(fuse.prefill(m, ids, pause=c.pause)), layers * math.ceil(len(ids) / 8)),
        "chunk": (lambda c: (lambda kv: (kv.k, kv.v))(fuse.precompute_chunk(m, (1,), chunks[1], pause=c.pause)),
                  layers - 1),
        "reuse": (lambda c: built(fuse.reuse(m, layout, c)), layers),
        "blend": (lambda c: built(fuse.blend(m, layout, 0.3, ctx=c)), layers),
        "queryaware": (lambda c: built(fuse.query_aware(m, layout, 0.3, ctx=c)), 2 * layers),
    }
    for name, (build, pauses) in builds.items():
        calls["n"] = 0
        with torch.inference_mode():
            quiet, paused = build(fuse.FuseContext()), build(ctx)
        assert calls["n"] == pauses, f"{name}: {calls['n']} pauses, expected {pauses}"
        assert all(torch.equal(x, y) for x, y in zip(quiet, paused, strict=True)), name


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_query_aware_weigh_and_ahead(models, family: str) -> None:
    """`weigh=share` and `ahead` change what the question's attention picks (each can), but at ratio 1.0
    both are still full prefill, and ahead leaves the reuse pass's cache as it was (its rows recomputed
    in a product of more rows: equal up to rounding)."""
    from kvfuse.fuse.queryaware import suffix_attention

    m = models[family]
    full, layout, prefix, chunks = _fused_case(m, 6)
    plain, reused = suffix_attention(m, layout, "all", weigh="mass")
    shared, _ = suffix_attention(m, layout, "all", weigh="share")
    ahead, drafted = suffix_attention(m, layout, "all", ahead=3)
    assert not torch.allclose(plain, shared) and not torch.allclose(plain, ahead)
    assert torch.equal(drafted.logits, reused.logits)
    _assert_close(drafted.cache.k, reused.cache.k, f"{family} ahead's keys")
    for options in ({"weigh": "share"}, {"ahead": 3}):
        _assert_close(fuse.query_aware(m, layout, 1.0, **options).logits, full.logits, f"{family} {options}@1", 1e-4)
    with pytest.raises(ValueError, match="weigh"):
        fuse.QueryAware(weigh="max")
    # weigh "auto": "value" where every layer counts, "mass" where only the full-attention layers do
    auto, _ = suffix_attention(m, layout, "all")
    assert torch.equal(auto, suffix_attention(m, layout, "all", weigh="value")[0])
    slides = any(m.cfg.window(i) is not None for i in range(m.cfg.num_layers))
    settled = fuse.for_model(fuse.get_fuser("queryaware"), m.cfg)
    assert isinstance(settled, fuse.QueryAware) and settled.weigh == ("mass" if slides else "value")
    assert fuse.for_model(settled, m.cfg) == settled and fuse.for_model(fuse.Blend(), m.cfg) == fuse.Blend()
    glob, _ = suffix_attention(m, layout, "global")
    assert torch.equal(glob, suffix_attention(m, layout, "global", weigh=settled.weigh)[0])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_query_aware_value_weigh(models, family: str) -> None:
    """`weigh=value` counts each token's probability times the L1 norm of its value vector, normalised
    again per head and query: a loop over heads, queries and tokens is its oracle; it changes the
    scores but not ratio 1.0 (full prefill), and with values of equal norm it is `share` itself."""
    from kvfuse.fuse.queryaware import suffix_attention, value_weighted

    g = torch.Generator().manual_seed(7)
    probs = torch.rand(6, 3, 5, generator=g)
    probs /= probs.sum(-1, keepdim=True)
    values = torch.randn(2, 5, 4, generator=g)
    got = value_weighted(probs, values, 6)
    for h in range(6):
        for s in range(3):
            w = [float(probs[h, s, c]) * float(values[h // 3, c].abs().sum()) for c in range(5)]
            assert torch.allclose(got[h, s], torch.tensor(w) / sum(w), atol=1e-6)
    same = torch.ones(2, 5, 4) * torch.tensor([1.0, -1.0, 1.0, -1.0])  # every token's |v|_1 is 4
    assert torch.allclose(value_weighted(probs, same, 6), probs, atol=1e-6)

    m = models[family]
    full, layout, _, _ = _fused_case(m, 6)
    shared, _ = suffix_attention(m, layout, "all", weigh="share")
    valued, _ = suffix_attention(m, layout, "all", weigh="value")
    assert not torch.allclose(shared, valued)
    assert torch.isclose(valued.sum(), shared.sum(), rtol=1e-4)  # one vote per head, query and counted layer
    _assert_close(fuse.query_aware(m, layout, 1.0, weigh="value").logits, full.logits, f"{family} value@1", 1e-4)
    assert fuse.for_model(fuse.QueryAware(weigh="value"), m.cfg) == fuse.QueryAware(weigh="value")


def _naive_hidden(m, ids: torch.Tensor, layer: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The tokens' input to `layer` by the naive per-layer path (the oracle of every residual stream)."""
    pos = torch.arange(ids.shape[0])
    h = m.embed(ids)
    for i in range(layer):
        h, _, _ = m.layer(i, h, pos)
    return h  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pass_that_begins_mid_model_equals_full_prefill(models, family: str) -> None:
    """fuse_chunks(resume=Resume(placed, begin=L, hidden)) over full prefill's KV, given every row's exact
    input to layer L, recomputes layers L.. into exactly full prefill; a begin without the rows' input, or
    with the wrong rows, or past the last layer, is refused."""
    m = models[family]
    prefix, chunks, suffix = _layout(11)
    ids = _t(prefix + sum(chunks, ()) + suffix)
    full = fuse.prefill(m, ids)
    at, caches = len(prefix), []
    for c in chunks:  # the chunks' exact KV, at their own positions
        caches.append(full.cache.slice(at, at + len(c)).clone())
        at += len(c)
    layout = fuse.FuseLayout.of(full.cache.slice(0, len(prefix)).clone(), caches, _t(suffix), [_t(c) for c in chunks])
    n, layers = sum(len(c) for c in chunks), m.cfg.num_layers
    hidden = _naive_hidden(m, ids, 2)[len(prefix):]
    placed = (full.cache.k.clone(), full.cache.v.clone())
    out = fuse.fuse_chunks(m, layout, [n] * layers, candidates=torch.arange(n), resume=fuse.Resume(placed, 2, hidden))
    _assert_close(out.logits, full.logits, f"{family} begin=2", 1e-4)
    _assert_close(out.cache.k, full.cache.k, f"{family} begin=2 keys", 1e-4)
    assert out.recomputed_token_layers == n * (layers - 2) and len(out.selected) == layers - 2
    with pytest.raises(ValueError, match="hidden input"):
        fuse.Resume(placed, 2)
    with pytest.raises(ValueError, match="rows"):
        fuse.fuse_chunks(m, layout, [n] * layers, candidates=torch.arange(n), resume=fuse.Resume(placed, 2, hidden[1:]))
    with pytest.raises(ValueError, match="cannot begin"):
        fuse.fuse_chunks(m, layout, [n] * layers, candidates=torch.arange(n),
                         resume=fuse.Resume(placed, layers, hidden))


@pytest.mark.parametrize("family", FAMILIES)
def test_precompute_keeps_the_chunks_residual_stream(models, family: str) -> None:
    """precompute_chunk(residual=L) keeps the chunk tokens' input to layer L (the naive path's), and the
    same KV as without it."""
    m = models[family]
    pre, chunk = (1, 5, 6, 7), rand_ids(9, 3)
    cache = fuse.precompute_chunk(m, pre, chunk, residual=2)
    assert cache.residual is not None and cache.residual.layer == 2
    _assert_close(cache.residual.hidden, _naive_hidden(m, _t(pre + chunk), 2)[len(pre):], f"{family} residual", 1e-5)
    plain = fuse.precompute_chunk(m, pre, chunk)
    assert plain.residual is None and torch.equal(plain.k, cache.k) and torch.equal(plain.v, cache.v)
    assert cache.residual_at(2) is cache.residual.hidden and cache.residual_at(1) is None
    assert cache.nbytes == plain.nbytes + cache.residual.hidden.numel() * 4
    for bad in (0, m.cfg.num_layers):
        with pytest.raises(ValueError, match="residual"):
            fuse.precompute_chunk(m, pre, chunk, residual=bad)


@pytest.mark.parametrize("family", FAMILIES)
def test_query_aware_skip_resumes_the_picks_from_their_chunks_residual(models, family: str) -> None:
    """queryaware with skip=2: below layer 2 the cache is plain reuse's; on layer 2 the picked tokens'
    KV is that of their chunk's residual stream (their own precompute's input to the layer); at ratio 0
    it is reuse, at 1.0 full prefill; chunks without a residual recompute from layer 0."""
    m = models[family]
    prefix, chunks, suffix = _layout(12)
    full = fuse.prefill(m, _t(prefix + sum(chunks, ()) + suffix))
    caches = [fuse.precompute_chunk(m, (1,), c, residual=2) for c in chunks]
    layout = _fused_layout(m, prefix, caches, chunks, suffix)
    plain = _fused_layout(m, prefix, [fuse.precompute_chunk(m, (1,), c) for c in chunks], chunks, suffix)
    reused = fuse.reuse(m, layout)
    _assert_close(fuse.query_aware(m, layout, 0.0, skip=2).logits, reused.logits, f"{family} skip @0", 1e-5)
    _assert_close(fuse.query_aware(m, layout, 1.0, skip=2).logits, full.logits, f"{family} skip @1", 1e-4)
    out = fuse.query_aware(m, layout, 0.4, skip=2, layers="all")
    n, layers, start = sum(len(c) for c in chunks), m.cfg.num_layers, len(prefix)
    picks = out.selected[0]
    assert len(out.selected) == layers - 2 and out.recomputed_token_layers == math.ceil(0.4 * n) * (layers - 2)
    assert torch.equal(out.cache.k[:2], reused.cache.k[:2]) and torch.equal(out.cache.v[:2], reused.cache.v[:2])
    resid = torch.cat([c.residual.hidden for c in caches])[picks]  # type: ignore[union-attr]
    k, v = m.key_value(2, resid, picks + start)
    _assert_close(out.cache.k[2][:, picks + start], k, f"{family} picks' keys on layer 2", 1e-5)
    _assert_close(out.cache.v[2][:, picks + start], v, f"{family} picks' values on layer 2", 1e-5)
    from_zero = fuse.query_aware(m, layout, 0.4, skip=0, layers="all")
    assert not torch.allclose(out.logits, from_zero.logits)
    assert torch.equal(fuse.query_aware(m, plain, 0.4, skip=2, layers="all").logits,
                       fuse.query_aware(m, plain, 0.4, skip=0, layers="all").logits)
    with pytest.raises(ValueError, match="skip"):
        fuse.query_aware(m, layout, 0.4, skip=layers)


def test_query_aware_skip_option(models) -> None:  # type: ignore[no-untyped-def]
    """skip is off by default; above 0 it is the layer whose residual the chunk caches keep; a spec
    sets it; a negative skip, or one the model has no layer for, is refused."""
    from kvfuse.fuse import QueryAware, parse_spec, residual_layer

    cfg = models["llama"].cfg
    assert QueryAware().skip == 0 and residual_layer(QueryAware()) is None and residual_layer(fuse.Blend()) is None
    fuser, ratio = parse_spec("queryaware@0.2:skip=3")
    assert fuser.skip == 3 and ratio == 0.2 and residual_layer(fuser) == 3  # type: ignore[attr-defined]
    assert residual_layer(fuse.for_model(fuser, cfg)) == 3 and fuse.spec_of(fuser, 0.2) == "queryaware@0.2:skip=3"
    with pytest.raises(ValueError, match="skip"):
        QueryAware(skip=-1)
    with pytest.raises(ValueError, match="skip"):
        parse_spec("queryaware@0.2:skip=x")
    with pytest.raises(ValueError, match="skip"):
        fuse.for_model(QueryAware(skip=4), cfg)  # the tiny models have 4 layers
