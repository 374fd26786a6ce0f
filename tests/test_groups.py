"""Precision `groups`: a GGUF's own blocks held exactly, products of their float32 dequantisation. The
oracles are gguf's own dequantisation, the converted float32 checkpoint and fp32's model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ggufs import write_tiny_gguf

from kvfuse import groups, precision
from kvfuse.checkpoints import gguf_of, resolve_model_path
from kvfuse.engine import Engine
from kvfuse.engine.sampling import SamplingParams
from kvfuse.metrics import kl_divergence
from kvfuse.request import Request
from kvfuse.weights import load_model

# where each block type keeps its float16 fields (random bytes there could be NaN)
HALVES = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
          "Q6_K": [208]}


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """A (rows, bytes) tensor of random blocks of a GGUF type, its float16 fields finite."""
    nbytes, per, _ = groups.BLOCKS[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    for at in HALVES[kind]:
        halves = rng.normal(0, 0.05, size=(rows, cols // per)).astype(np.float16)
        data[:, :, at : at + 2] = halves[..., None].view(np.uint8)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(groups.BLOCKS))
def test_blocks_dequantise_as_gguf_dequantises_them(kind: str) -> None:
    from gguf import GGMLQuantizationType, dequantize

    rows, cols = 6, 2 * groups.BLOCKS[kind][1]
    raw = random_blocks(kind, rows, cols, seed=3)
    g = groups.from_blocks(kind, raw, rows, cols)
    assert g is not None and g.shape == (rows, cols) and g.values.dtype == torch.int8
    want = dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols).astype(np.float32)
    assert torch.equal(g.dequantize(), torch.from_numpy(want))  # bit for bit
    assert groups.from_blocks("IQ2_XS", raw, rows, cols) is None  # a type it does not read


def test_quantise_stack_and_regroup_keep_the_weights() -> None:
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
    g = groups.quantize(w)
    assert g.size == 32 and g.offset is None
    step = g.scale.repeat_interleave(32, 1)
    assert bool(((g.dequantize() - w).abs() <= step / 2 + 1e-7).all())  # within half a step of each group
    assert groups.quantize(torch.randn(5, 40)).size == 8  # a width 32 does not divide: the largest that does
    small = groups.Groups(g.values[:8], g.scale[:8], torch.randn(8, 3), 32)
    halved = small.regroup(16)
    assert halved.size == 16 and torch.equal(halved.dequantize(), small.dequantize())
    both = groups.stack([g.rows(slice(0, 8)), halved])  # one without offsets, one with; two group sizes
    assert both.size == 16 and torch.equal(both.dequantize(), torch.cat([g.dequantize()[:8], small.dequantize()]))


def test_a_product_is_the_float_product_of_the_dequantised_weight(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = groups.quantize(torch.randn(50, 64, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    want = F.linear(x, g.dequantize())
    assert torch.allclose(groups.group_matmul(x, g), want, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(groups, "SLICE_ROWS", 7)  # a slice of rows at a time, into the reused buffer
    assert torch.allclose(groups.group_matmul(x, g), want, rtol=1e-6, atol=1e-6)
    with torch.inference_mode():  # in inference mode and out of it again: each its own buffer
        assert torch.allclose(groups.group_matmul(x, g), want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(groups.group_matmul(x, g), want, rtol=1e-6, atol=1e-6)
    table = groups.GroupEmbedding(g)
    assert torch.equal(table(torch.tensor([[4, 49]])), g.dequantize()[[4, 49]][None])
    assert torch.equal(table.table()[torch.tensor([3, 0])], g.dequantize()[[3, 0]])


QUANT = {"attn_q": "Q5_0", "attn_k": "Q8_0", "attn_v": "Q4_1", "attn_output": "Q4_0", "ffn_down": "Q5_1",
         "*": "Q8_0"}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_groups_holds_a_ggufs_blocks_exactly(tmp_path, monkeypatch, family: str) -> None:  # type: ignore[no-untyped-def]
    """Every linear and the tied table from the file's own blocks (a Llama's q and k rows back from
    llama.cpp's rotary order), dequantising to fp32's weights bit for bit; the model computes fp32's
    function, and greedy answers through the screen of its float32 head are the unscreened ones."""
    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path / "cache"))
    file = tmp_path / f"{family}.gguf"
    write_tiny_gguf(file, family, quant=QUANT)
    root = resolve_model_path(file)
    loaded, fp32 = load_model(root, "groups"), load_model(root, "fp32")
    assert gguf_of(root) is not None and loaded.fingerprint == fp32.fingerprint + "-groups"
    model = loaded.model
    assert precision.of(model) == "groups"
    linears = {n: m for n, m in model.named_modules() if isinstance(m, groups.GroupLinear)}
    assert len(linears) == 4 * model.cfg.num_layers + (0 if model.cfg.tie_embeddings else 1)
    state = fp32.model.state_dict()  # gguf's dequantisation, as transformers converts the file (test_gguf.py)
    for name, lin in linears.items():
        assert torch.equal(lin.groups.dequantize(), state[f"{name}.weight"]), name
    bf16 = load_model(root, "bf16").model  # bf16's float32 table: the same values, held as its groups
    assert isinstance(bf16.embed_tokens, groups.GroupEmbedding) and precision.of(bf16) == "bf16"
    assert torch.equal(bf16.embed_tokens.groups.dequantize(), state["embed_tokens.weight"])
    sizes = {lin.size for lin in linears.values()}
    assert sizes == {32}
    if model.cfg.tie_embeddings:
        table = model.embed_tokens
        assert isinstance(table, groups.GroupEmbedding)
        assert torch.equal(table.groups.dequantize(), state["embed_tokens.weight"])
    ids = torch.tensor([5, 77, 200, 9, 33, 100, 4, 250, 17, 64] * 3)
    with torch.inference_mode():
        got, want = model(ids), fp32.model(ids)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    req = Request(prefix=(5, 77, 200), chunks=((9, 33, 100, 4), (250, 17, 64)), suffix=(3, 8))
    screened, plain = Engine(model, loaded.fingerprint), Engine(model, loaded.fingerprint, greedy_screen=False)
    assert screened.blend_error is None and screened.greedy_head() is not None
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert screened.generate(req, "full", None, params).tokens == plain.generate(req, "full", None, params).tokens


def test_groups_quantises_a_checkpoint_without_blocks(tiny_models) -> None:  # type: ignore[no-untyped-def]
    root = tiny_models["qwen3"][0]
    model, fp32 = load_model(root, "groups").model, load_model(root, "fp32").model
    assert gguf_of(root) is None  # nothing to read blocks from: 8-bit groups of 32
    linears = [m for m in model.modules() if isinstance(m, groups.GroupLinear)]
    assert linears and all(m.offset is None and m.values.abs().max() == 127 for m in linears)
    ids = torch.tensor([1, 5, 9, 12, 30, 2, 7])
    with torch.inference_mode():
        kl = kl_divergence(fp32(ids)[-1], model(ids)[-1])
    assert 0.0 < kl < 0.01
