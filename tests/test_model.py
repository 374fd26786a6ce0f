import dataclasses
import json

import pytest
import torch
from tiny import FAMILIES

from kvfuse.config import ModelConfig, UnsupportedModelError
from kvfuse.weights import CheckpointError, load_model


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf(tiny_models, family: str) -> None:
    root, hf = tiny_models[family]
    model = load_model(root).model
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, ref = model(ids[0]), hf(ids).logits[0]
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel < 1e-4, f"{family}: max relative logit difference {rel:.2e}"


def test_family_flags_come_from_config(tiny_models) -> None:
    cfgs = {f: load_model(tiny_models[f][0]).model.cfg for f in FAMILIES}
    assert cfgs["gemma3"].qk_norm and cfgs["gemma3"].sandwich_norm and cfgs["gemma3"].embed_scale == 8.0
    assert cfgs["gemma3"].layer_types == ("sliding", "full", "sliding", "full")
    assert cfgs["gemma3"].rope(0).base == 10000.0 and cfgs["gemma3"].rope(1).base == 1000000.0
    assert cfgs["qwen3"].qk_norm and not cfgs["qwen3"].qkv_bias
    assert cfgs["qwen2"].qkv_bias and not cfgs["qwen2"].qk_norm
    assert cfgs["mistral"].window(0) == 7
    assert cfgs["llama"].rope(0).kind == "llama3"


def test_old_style_configs_parse() -> None:
    gemma = ModelConfig.from_hf_config({
        "model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "query_pre_attn_scalar": 8, "sliding_window": 4, "sliding_window_pattern": 6, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    })
    assert gemma.layer_types == ("sliding",) * 5 + ("full",)
    assert gemma.rope(5) .kind == "linear" and gemma.rope(5).factor == 8.0 and gemma.rope(0).kind == "default"
    llama = ModelConfig.from_hf_config({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "rope_theta": 5e5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    })
    assert llama.rope(0).kind == "llama3" and llama.rope(0).base == 5e5 and llama.num_kv_heads == 2


def test_unsupported_family_and_rope_are_refused() -> None:
    base = {"vocab_size": 10, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2}
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf_config({**base, "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf_config({**base, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2}})


def test_broken_checkpoints_get_clear_errors(tmp_path, tiny_models) -> None:
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)
    root, _ = tiny_models["llama"]
    (tmp_path / "config.json").write_text((root / "config.json").read_text())
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(str(root / "model.safetensors"))
    state.pop("model.norm.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="norm.weight"):
        load_model(tmp_path)


def test_fingerprint_differs_between_checkpoints(tiny_models) -> None:
    fps = {load_model(tiny_models[f][0]).fingerprint for f in FAMILIES}
    assert len(fps) == len(FAMILIES)
    cfg = json.loads((tiny_models["llama"][0] / "config.json").read_text())
    assert cfg["model_type"] == "llama"


@pytest.mark.parametrize("argv", [["generate", "--question", "q"], ["serve"], ["kb", "stats", "albaran"]])
def test_cli_reports_a_bad_model_dir_without_a_traceback(tmp_path, argv) -> None:  # type: ignore[no-untyped-def]
    from kvfuse.cli import main

    with pytest.raises(SystemExit, match=f"kvfuse: {tmp_path} is not a model directory: it has no config.json"):
        main([*argv, "--model", str(tmp_path)])


def test_serve_process_reports_a_server_that_exits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvfuse.server.process import serve_process

    with pytest.raises(RuntimeError, match="exited with status 1 before it was healthy"):
        with serve_process(["--model", str(tmp_path)], startup_s=120):
            pass


@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_attend_all_equals_attend_when_every_key_is_visible(tiny_models, family: str, softcap) -> None:
    import dataclasses

    model = load_model(tiny_models[family][0]).model
    model.cfg = dataclasses.replace(model.cfg, attn_softcap=softcap)
    cfg, g = model.cfg, torch.Generator().manual_seed(5)
    n = min(9, cfg.sliding_window or 9)  # every key within reach of the query on every layer
    k = torch.randn(cfg.num_kv_heads, n, cfg.head_dim, generator=g)
    v = torch.randn(cfg.num_kv_heads, n, cfg.head_dim, generator=g)
    q = torch.randn(cfg.num_heads, 1, cfg.head_dim, generator=g)
    k_pos, q_pos = torch.arange(30, 30 + n), torch.tensor([29 + n])  # one query at the last key's position
    for i in range(cfg.num_layers):
        want = model.attend(i, q, q_pos, k, v, k_pos)
        assert torch.allclose(model.attend_all(i, q, k, v), want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(model.attend_all(0, q, k[:, :2], v[:, :2]), want, atol=1e-3)  # it reads the keys given


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_rows_of_a_draft_attend_as_each_does_alone(tiny_models, family: str, softcap, shared: bool,
                                                   monkeypatch) -> None:
    """`attend_rows` on a full-attention layer: rows whose ends cross VALUE_BLOCK and SPLIT_KEYS boundaries
    each get bitwise the result they get alone, and `attend` over their own keys (the masked oracle)
    within float32 rounding; with the shared products refused (`shares_values` False) too."""
    import dataclasses

    from kvfuse import model as model_mod

    if not shared:
        monkeypatch.setattr(model_mod, "shares_values", lambda *a: False)
    model = load_model(tiny_models[family][0]).model
    model.cfg = dataclasses.replace(model.cfg, attn_softcap=softcap, num_kv_heads=1)  # Gemma 3's one kv head
    cfg, g = model.cfg, torch.Generator().manual_seed(6)
    if shared and not model_mod.shares_values(1, cfg.num_heads, cfg.head_dim, torch.float32, torch.device("cpu"),
                                              torch.get_num_threads()):
        pytest.skip("this BLAS sums a shared product's rows differently at these shapes: only the fallback runs")
    layer = next((i for i in range(cfg.num_layers) if cfg.window(i) is None), None)
    if layer is None:
        pytest.skip("no full-attention layer")
    for first in (model_mod.VALUE_BLOCK - 3, model_mod.SPLIT_KEYS - 2, model_mod.SPLIT_KEYS + 61):
        m = 7
        n = first + m
        k = torch.randn(cfg.num_kv_heads, n, cfg.head_dim, generator=g)
        v = torch.randn(cfg.num_kv_heads, n, cfg.head_dim, generator=g)
        q = torch.randn(cfg.num_heads, m, cfg.head_dim, generator=g)
        ends = [first + r + 1 for r in range(m)]
        together = model.attend_rows(layer, q, k, v, ends)
        assert together.shape == (m, cfg.num_heads * cfg.head_dim)
        for r, e in enumerate(ends):
            alone = model.attend_rows(layer, q[:, r : r + 1], k, v, [e])
            assert torch.equal(together[r], alone[0]), (first, r)
            want = model.attend(layer, q[:, r : r + 1], torch.tensor([e - 1]), k[:, :e], v[:, :e], torch.arange(e))
            assert torch.allclose(alone, want, atol=1e-5, rtol=1e-4), (alone - want).abs().max()
        assert not torch.allclose(together[0], together[-1], atol=1e-3)  # each row reads its own keys


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_rows_with_full_windows_attend_as_each_does_alone(tiny_models, softcap, batched: bool, monkeypatch) -> None:
    """`attend_windows` on a sliding layer of one kv head (Gemma 3's): a draft's rows, their windows views
    of the cache, each get bitwise their result alone, and `attend`'s over their own window (the masked
    oracle) within float32 rounding; with the batch refused (`batches_windows` False) too."""
    import dataclasses

    from kvfuse import model as model_mod

    if not batched:
        monkeypatch.setattr(model_mod, "batches_windows", lambda *a: False)
    model = load_model(tiny_models["gemma3"][0]).model
    model.cfg = dataclasses.replace(model.cfg, attn_softcap=softcap, num_kv_heads=1)
    cfg, g = model.cfg, torch.Generator().manual_seed(7)
    layer = next(i for i in range(cfg.num_layers) if cfg.window(i) is not None)
    w = cfg.window(layer)
    assert w is not None
    if batched and not model_mod.batches_windows(w, cfg.num_heads, cfg.head_dim, torch.float32,
                                                 torch.device("cpu"), torch.get_num_threads()):
        pytest.skip("this BLAS sums a batched window differently: only the fallback runs")
    m, first = 6, w + 5
    n = first + m + 3
    # as a step has them: the layer's K and V views of a (layers, kv, T, D) buffer at a non-zero offset,
    # and q a transposed view (heads, m, D) of the projection's rows
    buf_k, buf_v = (torch.randn(3, 1, n, cfg.head_dim, generator=g) for _ in range(2))
    k, v = buf_k[1], buf_v[1]
    q = torch.randn(m, cfg.num_heads, cfg.head_dim, generator=g).transpose(0, 1)
    ends = [first + r + 1 for r in range(m)]
    together = model.attend_windows(layer, q, k, v, ends)
    for r, e in enumerate(ends):
        alone = model.attend_windows(layer, q[:, r : r + 1], k, v, [e])
        assert torch.equal(together[r], alone[0]), r
        want = model.attend(layer, q[:, r : r + 1], torch.tensor([e - 1]), k[:, :e], v[:, :e], torch.arange(e))
        assert torch.allclose(alone, want, atol=1e-5, rtol=1e-4), (alone - want).abs().max()
    assert not torch.allclose(together[0], together[-1], atol=1e-3)


@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("family", ["gemma3", "mistral", "llama"])
def test_attention_to_a_range_of_keys_is_that_slice_of_the_weights(tiny_models, family: str, softcap) -> None:
    """The fast path of query-aware selection against its oracle, `attention_weights`: queries late and
    in the middle (so the causal mask, and on sliding layers the window, hides keys inside the range),
    ranges at either end and inside."""
    import dataclasses

    model = load_model(tiny_models[family][0]).model
    model.cfg = dataclasses.replace(model.cfg, attn_softcap=softcap)
    cfg, g = model.cfg, torch.Generator().manual_seed(11)
    k_pos = torch.arange(48)
    q_pos = torch.tensor([20, 40, 44, 45, 47])
    k = torch.randn(cfg.num_kv_heads, 48, cfg.head_dim, generator=g) * 3
    q = torch.randn(cfg.num_heads, len(q_pos), cfg.head_dim, generator=g) * 3
    for i in range(cfg.num_layers):
        full = model.attention_weights(i, q, q_pos, k, k_pos)
        for lo, hi in ((0, 48), (0, 10), (5, 42), (30, 48)):
            got = model.attention_to(i, q, q_pos, k, k_pos, lo, hi)
            assert got.shape == (cfg.num_heads, len(q_pos), hi - lo)
            assert torch.allclose(got, full[:, :, lo:hi], atol=1e-6, rtol=1e-5), (i, lo, hi)
            shared = model.attention_to(i, q, q_pos, k, k_pos, lo, hi, over_range=True)
            want = full[:, :, lo:hi] / full[:, :, lo:hi].sum(-1, keepdim=True)
            seen = full[:, :, lo:hi].sum(-1) > 0  # a query may see none of the range (its own key comes later)
            assert torch.allclose(shared[seen], want[seen], atol=1e-6, rtol=1e-5), (i, lo, hi)
            assert torch.equal(shared[~seen], torch.zeros_like(shared[~seen]))
    assert not torch.allclose(model.attention_to(0, q, q_pos, k, k_pos, 5, 42), full[:, :, 6:43], atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_plan_changes_nothing(tiny_models, family: str) -> None:
    """project and attend with a RowPlan (cos/sin and masks built once, reused over layers) give bit for
    bit what they give without one, on sparse queries among more keys; a plan found again by RowPlans
    is the same object, and one of other positions is a new one."""
    from kvfuse.model import RowPlan, RowPlans

    model = load_model(tiny_models[family][0]).model
    cfg, g = model.cfg, torch.Generator().manual_seed(8)
    k_pos = torch.arange(40)
    q_pos = torch.tensor([3, 4, 9, 17, 18, 30, 39])
    h = torch.randn(len(q_pos), cfg.hidden_size, generator=g)
    k = torch.randn(cfg.num_kv_heads, 40, cfg.head_dim, generator=g)
    v = torch.randn(cfg.num_kv_heads, 40, cfg.head_dim, generator=g)
    plan = RowPlan(cfg, q_pos, k_pos)
    with torch.no_grad():
        for i in range(cfg.num_layers):
            got, want = model.project(i, h, q_pos, plan), model.project(i, h, q_pos)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            planned = model.attend(i, got[0], q_pos, k, v, k_pos, plan)
            assert torch.equal(planned, model.attend(i, want[0], q_pos, k, v, k_pos))
    plans = RowPlans(cfg)
    first = plans.get(q_pos.clone(), k_pos)
    assert plans.get(q_pos.clone(), k_pos) is first and plans.get(q_pos + 1, k_pos) is not first


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stacked_projections_split_back(tiny_models, family: str, precision: str) -> None:
    """The checkpoint's q, k and v (and gate and up) weights load stacked; the q alone and the k and v
    alone (`query`, `key_value`) are the stacked product's parts, and a prefill's `project` (which runs
    the parts without joining them) gives the joined product's columns bit for bit."""
    from kvfuse.model import RowPlan

    model = load_model(tiny_models[family][0], precision).model
    names = set(model.state_dict())
    assert any(n.endswith("self_attn.qkv_proj.weight") for n in names) and not any("q_proj" in n for n in names)
    h, pos = torch.randn(6, model.cfg.hidden_size, generator=torch.Generator().manual_seed(2)), torch.arange(6)
    with torch.no_grad():
        for i in range(model.cfg.num_layers):
            q, k, v = model.project(i, h, pos)
            assert torch.equal(model.query(i, h, pos), q)
            assert all(torch.equal(a, b) for a, b in zip(model.key_value(i, h, pos), (k, v), strict=True))
            blk = model.block(i)
            attn, (cos, sin) = blk.self_attn, RowPlan(model.cfg, pos).rope(i)
            joined = attn.qkv_proj(blk.input_layernorm(h)).split((attn.q_size, attn.kv_size, attn.kv_size), -1)
            assert torch.equal(model._query(i, joined[0], cos, sin), q)
            assert all(torch.equal(a, b) for a, b in zip(model._key_value(i, *joined[1:], cos, sin), (k, v),
                                                         strict=True))


def _attention_cases(cfg: ModelConfig, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """(q, q_pos, k, v, k_pos) on ATTN_BLOCK + 44 keys: a causal prefill longer than a block, sparse
    queries among them (blend's), and a few queries at each end (a fused request's prefix tail and
    question, whose blocks read keys far apart)."""
    from kvfuse.model import ATTN_BLOCK

    g, n = torch.Generator().manual_seed(seed), ATTN_BLOCK + 44
    k_pos = torch.arange(n)
    k = torch.randn(cfg.num_kv_heads, n, cfg.head_dim, generator=g)
    v = torch.randn(cfg.num_kv_heads, n, cfg.head_dim, generator=g)
    positions = (k_pos, torch.sort(torch.randperm(n, generator=g)[: n // 5]).values,
                 torch.cat((k_pos[:5], k_pos[-9:])))
    return [(torch.randn(cfg.num_heads, len(p), cfg.head_dim, generator=g), p, k, v, k_pos) for p in positions]


def test_attention_blocks_of_sparse_queries_compute_few_masked_scores(tiny_models) -> None:
    """A fused request's queries are a fifth of the positions. `attend`'s blocks cover them in order,
    each reads the keys its queries can reach (a span of at most ATTN_BLOCK positions and, on a sliding
    layer, one window before it), and on full-attention layers the scores a block computes but masks
    are under a quarter of those it uses (blocks of ATTN_BLOCK queries spanning five times as many
    positions masked three quarters as many); a contiguous prefill keeps blocks of ATTN_BLOCK queries."""
    from kvfuse.model import ATTN_BLOCK, RowPlan, attention_mask

    cfg = load_model(tiny_models["gemma3"][0]).model.cfg  # sliding and full-attention layers
    n = 6 * ATTN_BLOCK
    k_pos = torch.arange(n)
    q_pos = torch.sort(torch.randperm(n, generator=torch.Generator().manual_seed(3))[: n // 5]).values
    assert {cfg.window(i) is None for i in range(cfg.num_layers)} == {True, False}
    for i in range(cfg.num_layers):
        blocks = RowPlan(cfg, q_pos, k_pos).blocks(i)
        assert [b[0] for b in blocks] == [0, *(b[1] for b in blocks[:-1])] and blocks[-1][1] == len(q_pos)
        used = sum(int(mask.sum()) for *_, mask in blocks)
        computed = sum((e - s) * (hi - lo) for s, e, lo, hi, _ in blocks)
        assert used == int(attention_mask(q_pos, k_pos, cfg.window(i)).sum())  # every score a query uses
        if cfg.window(i) is None:
            assert computed - used < used / 4, (i, computed, used)
        else:  # (the tiny model's window is 6: a block reads its span's keys and one window before)
            assert all(hi - lo <= ATTN_BLOCK + cfg.window(i) for _, _, lo, hi, _ in blocks)
        contiguous = RowPlan(cfg, k_pos, k_pos).blocks(i)
        assert [(s, e) for s, e, *_ in contiguous] == [(s, s + ATTN_BLOCK) for s in range(0, n, ATTN_BLOCK)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("one_kv_head", [False, True])
def test_a_low_attentions_additive_masks_are_its_boolean_masks(tiny_models, family: str, one_kv_head: bool) -> None:
    """bf16's prefill attention adds a bfloat16 mask (0 or -inf, `RowPlan.blocks` with a dtype) to its
    scores: the same blocks as the boolean masks', and bit for bit the attention that fills the masked
    scores with -inf instead, batched by kv head (the naive way), on a causal prefill and on sparse
    queries among more keys; with the model's kv heads, and with one (Gemma 3's: its own path, which
    orders a block's rows by query, not by head), on queries laid out as `Decoder._query` returns them
    and heads first."""
    from kvfuse.model import RowPlan

    model = load_model(tiny_models[family][0], "bf16").model
    cfg, dt = model.cfg, torch.bfloat16
    if one_kv_head:
        cfg = dataclasses.replace(cfg, num_kv_heads=1)
    for n, (q, q_pos, k, v, k_pos) in enumerate(_attention_cases(cfg, seed=12)):
        if n % 2:  # `_query`'s layout: (heads, T, D), a view of (T, heads, D)
            q = q.transpose(0, 1).contiguous().transpose(0, 1)
        plan = RowPlan(cfg, q_pos, k_pos)
        for i in range(cfg.num_layers):
            masks, biases = plan.blocks(i), plan.blocks(i, dt)
            assert [b[:4] for b in masks] == [b[:4] for b in biases]
            assert all(b[4].dtype == dt and torch.equal(b[4], torch.where(m[4], 0.0, float("-inf")).to(dt))
                       for m, b in zip(masks, biases, strict=True))
            parts = []  # the attention with the masked scores filled (the naive way)
            for s, e, lo, hi, mask in masks:
                group, tq = cfg.num_heads // cfg.num_kv_heads, e - s
                qs = (q[:, s:e] * cfg.query_scale).to(dt).reshape(cfg.num_kv_heads, group * tq, -1)
                scores = torch.bmm(qs, k[:, lo:hi].to(dt).transpose(1, 2)).view(cfg.num_kv_heads, group, tq, -1)
                probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
                parts.append(torch.bmm(probs.flatten(1, 2), v[:, lo:hi].to(dt)).view(cfg.num_heads, tq, -1))
            want = torch.cat(parts, 1).transpose(0, 1).reshape(len(q_pos), -1)
            assert torch.equal(model.attend(i, q, q_pos, k, v, k_pos, plan), want)


def _attention_in_float64(cfg: ModelConfig, i: int, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The textbook masked softmax attention in float64 (the oracle of `attend`'s fast paths)."""
    from kvfuse.model import attention_mask

    group = cfg.num_heads // cfg.num_kv_heads
    kk, vv = (x.double().repeat_interleave(group, 0) for x in (k, v))
    scores = (q.double() @ kk.transpose(1, 2)) * cfg.query_scale
    scores = scores.masked_fill(~attention_mask(q_pos, k_pos, cfg.window(i)), float("-inf"))
    return (torch.softmax(scores, -1) @ vv).transpose(0, 1).reshape(q.shape[1], -1)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_a_bf16_models_prefill_attention_runs_in_bfloat16_close_to_float64(tiny_models, family: str) -> None:
    """bf16 (on the CPU) runs `attend`'s products in bfloat16 and fp32 keeps SDPA's float32 kernel; on a
    causal prefill longer than ATTN_BLOCK and on sparse queries among more keys (blend), every layer's
    result (bfloat16, what the output projection reads) is the float64 oracle's within bfloat16
    rounding (fp32's within float32's), and not fp32's bit for bit (it really ran in bfloat16)."""
    models = {p: load_model(tiny_models[family][0], p).model for p in ("fp32", "bf16")}
    assert models["fp32"].attention_dtype is None and models["bf16"].attention_dtype == torch.bfloat16
    cfg = models["fp32"].cfg
    for q, q_pos, k, v, k_pos in _attention_cases(cfg, seed=11):
        for i in range(cfg.num_layers):
            want = _attention_in_float64(cfg, i, q, q_pos, k, v, k_pos)
            exact = models["fp32"].attend(i, q, q_pos, k, v, k_pos)
            low = models["bf16"].attend(i, q, q_pos, k, v, k_pos)
            assert low.dtype == torch.bfloat16 and low.shape == want.shape  # handed to o_proj as it is
            assert (exact.double() - want).abs().max() < 1e-5
            err = (low.double() - want).abs().max()
            assert err < 2 * 2**-8 * v.abs().max(), (i, err)
            assert not torch.equal(low.float(), exact)
