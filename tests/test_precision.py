"""Precisions (fp32, bf16, int8, w8a8): what each computes, against the float32 oracle, and that they never mix."""

import pytest
import torch
from conftest import rand_ids

from kvfuse import checkpoints, groups, packed, precision, quant, w8a8
from kvfuse.engine import Request
from kvfuse.engine.sampling import SamplingParams
from kvfuse.metrics import kl_divergence
from kvfuse.w8a8 import W8A8Embedding, W8A8Linear
from kvfuse.weights import load_model


def _state_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_int8_rows_are_the_dequantised_weight(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 48, generator=g)
    q, scale = quant.quantize_rows(w)
    monkeypatch.setattr(quant, "QUANT_ROWS", 7)  # in blocks of rows: the same result
    q7, scale7 = quant.quantize_rows(w)
    assert torch.equal(q, q7) and torch.equal(scale, scale7)
    deq = q.float() * scale.float()[:, None]
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert float((deq - w).abs().max()) <= float(scale.float().max()) / 2 + 1e-6  # rounding to nearest
    lin = torch.nn.Linear(48, 48)
    lin.weight.data = w
    x = torch.randn(5, 48, generator=g)
    layer = quant.Int8Linear(lin)
    got = layer(x)
    want = x.to(torch.bfloat16).float() @ deq.T + lin.bias  # the kernel reads its input in bfloat16
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=2**-7, atol=2**-6)
    long = torch.randn(quant.KERNEL_ROWS + 1, 48, generator=g)  # a longer product dequantises: float32 exactly
    assert torch.allclose(layer(long), long @ deq.T + lin.bias, rtol=1e-5, atol=1e-5)
    emb = torch.nn.Embedding(48, 48)
    emb.weight.data = w
    table = quant.Int8Embedding(emb.weight)
    ids = torch.tensor([3, 0, 47, 3])
    assert table(ids).dtype == torch.float32 and torch.allclose(table(ids), deq[ids], rtol=1e-6, atol=0)
    assert table.float().scale.dtype == quant.ACT_DTYPE  # casting the model keeps the kernel's scale dtype
    assert torch.allclose(table.linear(x).float(), x.to(torch.bfloat16).float() @ deq.T, rtol=2**-7, atol=2**-6)
    odd = torch.nn.Linear(40, 48)  # rows of 40: past the AVX-512 kernel's reach, so dequantised, exactly
    odd_layer = quant.Int8Linear(odd)
    odd_deq = quant.dequantize(odd_layer.q, odd_layer.scale, torch.float32)
    assert torch.allclose(odd_layer(x[:, :40]), x[:, :40] @ odd_deq.T + odd.bias, rtol=1e-5, atol=1e-5)


def test_an_int8_table_is_quantised_from_the_file_a_block_of_rows_at_a_time(tiny_models, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    root = tiny_models["gemma3"][0]  # a tied table
    monkeypatch.setattr(quant, "QUANT_ROWS", 7)
    reads: list[slice] = []
    read = checkpoints.FileRows.__getitem__
    monkeypatch.setattr(checkpoints.FileRows, "__getitem__", lambda self, rows: reads.append(rows) or read(self, rows))
    table = load_model(root, "int8").model.embed_tokens
    whole = load_model(root, "fp32").model.embed_tokens.weight
    q, scale = quant.quantize_rows(whole)
    assert isinstance(table, quant.Int8Embedding) and (table.num_embeddings, table.embedding_dim) == whole.shape
    assert torch.equal(table.q, q) and torch.equal(table.scale, scale)  # the same as quantising it whole
    assert [(r.start, r.stop) for r in reads] == [(a, a + 7) for a in range(0, whole.shape[0], 7)]


def test_a_precision_is_part_of_the_fingerprint(tiny_models) -> None:
    root = tiny_models["llama"][0]
    fps = {p: load_model(root, p).fingerprint for p in precision.PRECISIONS}
    assert len(set(fps.values())) == len(precision.PRECISIONS) == 6
    assert fps["fp32"] == load_model(root).fingerprint  # fp32 keeps the checkpoint's own
    with pytest.raises(ValueError, match="choose one of fp32, bf16, int8, w8a8, groups"):
        load_model(root, "fp8")


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_each_precision_computes_what_it_says(tiny_models, family: str) -> None:
    root = tiny_models[family][0]
    models = {p: load_model(root, p).model for p in precision.PRECISIONS}
    assert models["fp32"].compute_dtype == torch.float32
    assert {p: precision.of(m) for p, m in models.items()} == {p: p for p in precision.PRECISIONS}
    assert models["bf16"].compute_dtype == torch.float32  # bfloat16 layer weights, float32 activations
    assert models["int8"].compute_dtype == torch.float32  # int8 weights, float32 activations
    bf16_linears = [m for m in models["bf16"].modules() if isinstance(m, packed.PackedLinear)]
    assert len(bf16_linears) == 4 * models["bf16"].cfg.num_layers
    assert all(m.dtype == torch.bfloat16 and m.parts[0].dtype == torch.bfloat16 for m in bf16_linears)
    assert not [m for m in models["bf16"].layers.modules() if isinstance(m, torch.nn.Linear)]
    linears = [m for m in models["int8"].modules() if isinstance(m, torch.nn.Linear)]
    assert not linears and any(isinstance(m, quant.Int8Linear) for m in models["int8"].modules())
    assert isinstance(models["int8"].embed_tokens, quant.Int8Embedding) == models["int8"].cfg.tie_embeddings
    assert _state_bytes(models["int8"]) < 0.5 * _state_bytes(models["fp32"])
    assert _state_bytes(models["bf16"].layers) <= 0.5 * _state_bytes(models["fp32"].layers) + 4096  # norms stay float32
    w8a8_linears = [m for m in models["w8a8"].layers.modules() if isinstance(m, W8A8Linear)]
    assert len(w8a8_linears) == 4 * models["w8a8"].cfg.num_layers
    assert not [m for m in models["w8a8"].modules() if isinstance(m, torch.nn.Linear | quant.Int8Linear)]
    assert isinstance(models["w8a8"].embed_tokens, W8A8Embedding) == models["w8a8"].cfg.tie_embeddings
    group_linears = [m for m in models["groups"].layers.modules() if isinstance(m, groups.GroupLinear)]
    assert len(group_linears) == 4 * models["groups"].cfg.num_layers  # quantised: a checkpoint without blocks
    assert not [m for m in models["groups"].modules() if isinstance(m, torch.nn.Linear)]
    assert isinstance(models["groups"].embed_tokens, groups.GroupEmbedding) == models["groups"].cfg.tie_embeddings
    assert _state_bytes(models["groups"]) < 0.5 * _state_bytes(models["fp32"])
    ids = torch.tensor((1,) + rand_ids(30, 7))
    with torch.inference_mode():
        ref = models["fp32"](ids)[-1]
        for p in ("bf16", "int8", "w8a8", "groups"):
            got = models[p](ids)[-1]
            assert got.dtype == torch.float32
            assert kl_divergence(ref, got) < 0.05, p  # close to the oracle, not equal to it
            assert kl_divergence(ref, got) > 0.0, p  # and really computed at another precision


@pytest.mark.parametrize("p", ["bf16", "int8", "w8a8", "groups"])
def test_fusion_is_available_at_every_precision(engine_at, p: str) -> None:
    e = engine_at("gemma3", p)
    assert e.blend_error is None
    # the int8 screen's bound is for a float32 head: bf16's and groups' are, int8's and w8a8's are int8
    assert (e.greedy_head() is not None) == (p in ("bf16", "groups"))
    req = Request(prefix=(1,) + rand_ids(9, 1), chunks=(rand_ids(12, 2), rand_ids(8, 3)), suffix=rand_ids(4, 4))
    e.precompute(req, "blend")
    keys = {e.cache.chunk_key(c) for c in req.chunks}
    assert all(k in e.store for k in keys)
    fp32 = engine_at("gemma3", "fp32")
    assert keys.isdisjoint(fp32.cache.chunk_key(c) for c in req.chunks)  # never read at another precision
    out = e.generate(req, "blend", 0.5, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.tokens) == 4 and out.first_logits.dtype == torch.float32
    # stored in what holds the KV exactly: bfloat16 for bf16, whose keys and values are rounded to it
    assert e.kv_dtype == (torch.bfloat16 if p == "bf16" else torch.float32) == e.model.kv_dtype
    assert e.cache.chunk_cache(req.chunks[0])[0].k.dtype == e.kv_dtype
    assert fp32.kv_dtype == torch.float32


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_a_bf16_models_caches_are_stored_in_bfloat16_losing_nothing(engine_at, family: str) -> None:
    """bf16 rounds keys and values to bfloat16 as it computes them (its prefill attention reads them so),
    so the store keeps them in bfloat16, half fp32's bytes, and what a request reads back is what a full
    prefill holds, bit for bit."""
    e, fp32 = engine_at(family, "bf16"), engine_at(family, "fp32")
    req = Request(prefix=(1,) + rand_ids(40, 21), chunks=(), suffix=rand_ids(5, 22))
    full = e.prefill(req, "full").fused.cache
    for t in (full.k, full.v):
        assert torch.equal(t, t.to(torch.bfloat16).float())  # held in float32, bfloat16 numbers
    loose = fp32.prefill(req, "full").fused.cache.k  # fp32's are not: the test can tell
    assert not torch.equal(loose, loose.to(torch.bfloat16).float())
    e.precompute(req, "prefix")
    blocks = e.cache.request_keys(req, e.validate(req, "prefix", None)).blocks
    stored = [e.store.get(h) for h in blocks]
    assert stored and all(c is not None and c.k.dtype == torch.bfloat16 for c in stored)
    bs = e.cache.block_size
    for j, c in enumerate(stored):
        assert c is not None
        assert torch.equal(c.k.float(), full.k[:, :, j * bs : (j + 1) * bs])
        assert torch.equal(c.v.float(), full.v[:, :, j * bs : (j + 1) * bs])
    assert e.generate(req, "prefix", params=SamplingParams(max_tokens=4, ignore_eos=True)).tokens == \
        e.generate(req, "full", params=SamplingParams(max_tokens=4, ignore_eos=True)).tokens


def test_the_int8_kernel_gives_each_row_the_same_result_in_any_batch() -> None:
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(64, 96, bias=False)
    layer = quant.Int8Linear(lin)
    x = torch.randn(17, 64, generator=g)
    together = layer(x)
    assert together.shape == (17, 96) and together.dtype == torch.float32
    assert all(torch.equal(layer(x[i : i + 1])[0], together[i]) for i in range(17))


needs_onednn = pytest.mark.skipif(not packed.available(), reason="this PyTorch has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("shape", [(64, 96), (640, 1536), (2048, 640)])
def test_a_packed_linear_is_the_linear_and_its_rows_do_not_depend_on_the_batch(shape: tuple[int, int]) -> None:
    inp, out = shape
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(inp, out, bias=True)
    with torch.no_grad():
        lin.weight.normal_(0, inp**-0.5, generator=g)
        lin.bias.normal_(generator=g)
    layer = packed.PackedLinear(lin, (out // 3,))
    x = torch.randn(40, inp, generator=g)
    together = layer(x)
    assert torch.allclose(together, lin(x), atol=1e-4, rtol=1e-5)  # the oracle: the plain layer
    assert not torch.equal(layer(x[:2]), torch.zeros(2, out))
    # a row's result is bitwise the same beside any other rows, from 2 rows up (decode.MIN_ROWS)
    for i in range(0, 40, 7):
        pair = torch.stack((x[i], x[(i + 1) % 40]))
        assert torch.equal(layer(pair)[0], together[i])
    # the parts alone are exactly forward's columns; a range that cuts a part is refused
    assert torch.equal(layer.linear_rows(x, 0, out // 3), together[:, : out // 3])
    assert torch.equal(layer.linear_rows(x, out // 3, out), together[:, out // 3 :])
    with pytest.raises(ValueError, match="not whole parts"):
        layer.linear_rows(x, 1, out)
    state = layer.state_dict()
    assert torch.equal(state["weight"], lin.weight) and torch.equal(state["bias"], lin.bias)


needs_fp16 = pytest.mark.skipif(not (packed.available() and packed.fp16_steps_available()),
                                reason="needs oneDNN and FBGEMM's float16 linear")


@needs_fp16
@pytest.mark.parametrize("shape", [(64, 96), (640, 1536), (2048, 640)])
def test_a_bf16_layers_steps_multiply_its_bf16_weight_in_float32(shape: tuple[int, int]) -> None:
    """A decoding step's product (`PackedLinear.step`) is the bfloat16-rounded weight (held in float16)
    times the float32 rows, plus the bias: against float64 on the same rounded weight, it is as close as
    float32 accumulation gets, closer than the prefill's bfloat16 rows; each row's result is the same
    beside any other rows, one to 16 of them."""
    inp, out = shape
    g = torch.Generator().manual_seed(4)
    lin = torch.nn.Linear(inp, out, bias=True)
    with torch.no_grad():
        lin.weight.normal_(0, inp**-0.5, generator=g)
        lin.weight[0, :8] = torch.tensor([1e-5, -3e-6, 2e-7, 5e-8, 1e-9, 0.0, 70.0, -1e-3])  # tiny and large ones
        lin.bias.normal_(generator=g)
    layer = packed.PackedLinear(lin, (out // 3,), torch.bfloat16, steps=True)
    plain = packed.PackedLinear(lin, (out // 3,), torch.bfloat16)
    assert layer.step_parts and not plain.step_parts
    x = torch.randn(16, inp, generator=g)
    w = lin.weight.detach().bfloat16().double()  # the weight the layer holds
    want = x.double() @ w.T + lin.bias.detach().double()
    err = lambda y: float((y.double() - want).norm() / want.norm())  # noqa: E731
    steps = layer.step(x)
    assert err(steps) < 1e-5  # float32 rows: float16 keeps every bfloat16 weight of its normal range exactly
    assert err(layer(x)) > 3 * err(steps)  # the prefill's product rounds its rows to bfloat16
    assert torch.equal(plain.step(x), plain(x))  # without the copy, a step is the prefill's product
    for m in (1, 2, 5, 16):  # a row alone, in a pair, in a draft, in a batch: the same bits
        assert torch.equal(layer.step(x[:m]), steps[:m])
    assert torch.equal(layer.step(x[3:4]), steps[3:4])
    whole = packed.PackedLinear(lin, (), torch.bfloat16, steps=True)  # one part: the same columns
    assert torch.allclose(whole.step(x), steps, atol=1e-5, rtol=1e-5)
    huge = torch.nn.Linear(inp, out)
    with torch.no_grad():
        huge.weight[0, 0] = 1e5  # beyond float16's range: no copy, steps run the prefill's kernel
    assert not packed.PackedLinear(huge, (), torch.bfloat16, steps=True).step_parts


@needs_onednn
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_a_bf16_prefills_mlp_runs_its_activation_inside_the_gate_product(tiny_models, family: str) -> None:
    """bf16 holds each MLP's gate and up as two parts and runs a prefill's hidden rows through `gated`
    (Gemma's gelu-tanh and Llama's silu applied by oneDNN to the gate product's float32 sums, each
    product rounded once to bfloat16): every layer's MLP is the float64 oracle on the same rounded
    weights within bfloat16 rounding. fp32 never gates, and decoding steps keep their float32 path."""
    import torch.nn.functional as F

    models = {p: load_model(tiny_models[family][0], p).model for p in ("fp32", "bf16")}
    g = torch.Generator().manual_seed(5)
    for exact, blk in zip(models["fp32"].layers, models["bf16"].layers, strict=True):
        mlp, gate_up = blk.mlp, blk.mlp.gate_up_proj
        assert gate_up.gates(mlp.activation) and not exact.mlp.gate_up_proj.gates(mlp.activation)
        x = torch.randn(37, gate_up.in_features, generator=g)
        w = gate_up.state_dict()["weight"].double()  # the bfloat16 weights the layer holds
        gate, up = (x.bfloat16().double() @ w.T).split(mlp.inter, -1)
        act = F.gelu(gate, approximate="tanh") if mlp.activation == "gelu_tanh" else F.silu(gate)
        want = (act * up).bfloat16().double() @ mlp.down_proj.state_dict()["weight"].double().T
        with torch.inference_mode():
            got = mlp(x)
            assert torch.equal(got, mlp.down_proj(gate_up.gated(x, mlp.activation)))  # the path it took
            steps = mlp(x, step=True)
        assert gate_up.gated(x, mlp.activation).dtype == torch.bfloat16
        assert float((got.double() - want).norm() / want.norm()) < 2**-7
        assert not torch.equal(steps, got)  # steps: float32 rows on the float16 copy, the activation in torch


@needs_fp16
def test_a_bf16_models_decoding_steps_run_the_float16_copy(engine_at) -> None:
    """bf16's layers keep the float16 copy for steps and fp32's do not (the oracle stays float32). A
    step's hidden states are the naive path's (`Decoder.forward`) within bfloat16 rounding, and closer
    to fp32's than the same steps on the prefill's kernel, which rounds each row to bfloat16."""
    from kvfuse.engine.decode import Slot, step_hidden

    e, oracle = engine_at("gemma3", "bf16"), engine_at("gemma3", "fp32")
    linears = {p: [m for m in x.model.modules() if isinstance(m, packed.PackedLinear)] for p, x in
               (("bf16", e), ("fp32", oracle))}
    assert linears["bf16"] and all(m.step_parts for m in linears["bf16"])
    assert not any(m.step_parts for m in linears["fp32"])
    req = Request(prefix=(1,) + rand_ids(30, 3), chunks=(), suffix=rand_ids(4, 4))
    toks = list(rand_ids(6, 7))

    def steps() -> torch.Tensor:
        with torch.inference_mode():
            slot = Slot(e.model, e.prefill(req, room=8).fused.cache, 8)
            return torch.cat([step_hidden(e.model, [slot], [t]) for t in toks])

    ids = torch.tensor(list(req.prefix + req.suffix) + toks)
    with torch.inference_mode():
        naive = e.model(ids)[-6:]
        want = oracle.model(ids)[-6:]
    fast = e.model.logits(steps())
    copies = [m.step_parts for m in linears["bf16"]]
    try:
        for m in linears["bf16"]:
            m.step_parts = []
        slow = e.model.logits(steps())
    finally:
        for m, c in zip(linears["bf16"], copies, strict=True):
            m.step_parts = c
    assert torch.allclose(fast, naive, atol=0.05, rtol=0.02), (fast - naive).abs().max()
    assert not torch.equal(fast, slow)
    assert (fast - want).abs().mean() < (slow - want).abs().mean()


@needs_onednn
def test_an_fp32_model_runs_packed_layers_close_to_the_plain_ones(tiny_models) -> None:
    root = tiny_models["qwen2"][0]  # q, k and v with biases
    model = load_model(root, "fp32").model
    plain = load_model(root, "fp32").model
    for blk in plain.layers:  # unpacked from the names a packed layer's state keeps: the checkpoint's layers
        for parent, name in ((blk.self_attn, "qkv_proj"), (blk.self_attn, "o_proj"), (blk.mlp, "gate_up_proj"),
                             (blk.mlp, "down_proj")):
            old = getattr(parent, name)
            lin = torch.nn.Linear(old.in_features, old.out_features, bias="bias" in old.state_dict())
            lin.load_state_dict(old.state_dict())
            setattr(parent, name, lin)
    assert any(isinstance(m, packed.PackedLinear) for m in model.modules())
    assert not any(isinstance(m, packed.PackedLinear) for m in plain.modules())
    ids = torch.tensor((1,) + rand_ids(30, 9))
    with torch.inference_mode():
        got, want = model(ids), plain(ids)
    assert torch.allclose(got, want, atol=1e-4) and not torch.equal(got, torch.zeros_like(got))


def _w8a8_oracle(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """Each row of x rounded to integers in [-n, n] on its own scale, times the int8 rows, in float64."""
    s = x.double().abs().amax(1, keepdim=True) / n
    ints = torch.round(x.double() / s)
    return (ints @ q.double().T) * s * scale.double()


@pytest.mark.parametrize("n", [127, 63])  # the VNNI range, and the 7-bit one of CPUs without VNNI
def test_w8a8_products_are_int8_rows_times_rounded_activation_rows(monkeypatch, n: int) -> None:
    if not w8a8.available():
        pytest.skip("this PyTorch has no FBGEMM")
    monkeypatch.setattr(w8a8, "levels", lambda: n)
    g = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(640, 96, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 640, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(96, generator=g))
    layer = W8A8Linear(lin, splits=(32,))
    q, scale = quant.quantize_rows(lin.weight)
    x = torch.randn(33, 640, generator=g) * torch.linspace(0.1, 12, 640)  # channels of very different sizes
    x[:, 7] = 40.0  # an outlier channel, as Gemma's hidden states have
    got = layer(x)
    want = _w8a8_oracle(x, q, scale.float(), n) + lin.bias.double()
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4), (got.double() - want).abs().max()
    # every row on its own, in any batch: bitwise
    assert all(torch.equal(layer(x[i : i + k])[0], got[i]) for i, k in ((0, 1), (5, 2), (9, 8), (32, 1)))
    # the parts alone give exactly forward's columns
    assert torch.equal(torch.cat((layer.linear_rows(x, 0, 32), layer.linear_rows(x, 32, 96)), -1), got)
    with pytest.raises(ValueError, match="whole parts"):
        layer.linear_rows(x, 0, 40)
    # the state names the dequantised weight, as an nn.Linear's
    assert torch.equal(layer.state_dict()["weight"], quant.dequantize(q, scale, torch.float32))


def test_w8a8_levels_come_from_the_cpu_flags(monkeypatch, tmp_path) -> None:
    from pathlib import Path

    real = Path.read_text
    for flags, want in (("fpu avx2 fma", 63), ("fpu avx2 avx512f avx512_vnni", 127), ("avx2 avx_vnni", 127)):
        monkeypatch.setattr(Path, "read_text", lambda self, *a, f=flags, **k: f"processor: 0\nflags\t: {f}\n"
                            if str(self) == "/proc/cpuinfo" else real(self, *a, **k))
        w8a8.levels.cache_clear()
        assert w8a8.levels() == want, flags
    w8a8.levels.cache_clear()


def test_cli_default_precision_follows_the_cpu_flags(monkeypatch) -> None:
    """Issue M's rule, per CPU class measured: bf16 with avx512_bf16 and no AMX, fp32 on AMX and AVX2 hosts;
    the library's default stays the fp32 oracle, and `--help` names the CPU's default."""
    from kvfuse import defaults
    from kvfuse import precision as prec
    from kvfuse.cli.args import model_flag

    for flags, want in ((set(), "fp32"), ({"avx2", "fma"}, "fp32"), ({"avx512f", "avx512_bf16"}, "bf16"),
                        ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "fp32")):
        monkeypatch.setattr(prec, "cpu_flags", lambda f=frozenset(flags): f)
        prec.default_precision.cache_clear()
        assert prec.default_precision() == want, flags
        import argparse

        p = argparse.ArgumentParser()
        model_flag(p)
        assert p.parse_args([]).precision == want and f"(default: {want})" in " ".join(p.format_help().split())
    monkeypatch.undo()  # this machine's flags again: the cached default must be this CPU's, for later tests
    prec.default_precision.cache_clear()
    assert prec.DEFAULT_PRECISION == "fp32" and prec.default_precision() in prec.PRECISIONS
    assert isinstance(defaults.cpu_flags(), frozenset)
