"""Precision `lowbit`: a GGUF's blocks packed at 4 or 8 bits, products on kvfuse's kernel for few rows.
The oracles: gguf's own dequantisation (bit for bit), the float product of the dequantised weight with
the kernel's rounded input rows (float64), the plain float product, and fp32's model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ggufs import FAMILIES, write_tiny_gguf
from test_groups import random_blocks

from kvfuse import groups, lowbit, precision
from kvfuse.checkpoints import resolve_model_path
from kvfuse.engine.decode import batch_limit
from kvfuse.metrics import kl_divergence
from kvfuse.weights import load_model

pytestmark = pytest.mark.skipif(not lowbit.available(), reason="no AVX2 CPU or C compiler for the kernel")


def _weight(bits: int, size: int, offset: bool, signed: bool, rows: int = 48, cols: int = 256, seed: int = 0
            ) -> tuple[lowbit.Packed, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lo, hi = ((-8, 8) if signed else (0, 16)) if bits == 4 else (-128, 128)
    values = torch.randint(lo, hi, (rows, cols), generator=gen).to(torch.int8)
    scale = torch.rand(rows, cols // size, generator=gen) * 0.02
    off = torch.randn(rows, cols // size, generator=gen) * 0.05 if offset else None
    g = groups.Groups(values, scale, off, size)
    return lowbit.pack(values, scale, off, size, bits), g.dequantize()


def _rounded_oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The product the kernel computes, in float64: each input row rounded to int8 per block of 32 on
    its own absolute maximum, times the float weight."""
    xb = x.double().view(x.shape[0], -1, 32)
    a = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(a > 0, torch.round(xb / a.clamp_min(1e-300)), torch.zeros_like(xb)).clamp(-127, 127)
    return (q * a).view_as(x) @ w.double().T


KINDS = [(4, 32, True, False), (4, 32, False, True), (8, 32, False, True), (8, 16, False, True), (8, 32, True, False)]


@pytest.mark.parametrize(("bits", "size", "offset", "signed"), KINDS)
def test_products_are_the_dequantised_weights_on_rounded_rows(bits: int, size: int, offset: bool, signed: bool
                                                              ) -> None:
    packed, w = _weight(bits, size, offset, signed)
    assert torch.equal(packed.dequantize(), w)  # s * (q - zero) + o, bit for bit
    assert packed.nbytes < (0.8 if bits == 4 else 1.3) * w.numel()
    x = torch.randn(16, w.shape[1], generator=torch.Generator().manual_seed(1))
    for rows in (1, 3, 4, 7, 16):
        got = lowbit.matmul(x[:rows], packed).double()
        want = _rounded_oracle(x[:rows], w)
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5, rows
        plain = x[:rows].double() @ w.double().T  # and the rounding of the input costs about 1%
        assert float((got - plain).norm() / plain.norm()) < 2e-2


@pytest.mark.parametrize(("bits", "size", "offset", "signed"), KINDS)
def test_a_batched_row_equals_the_row_alone(bits: int, size: int, offset: bool, signed: bool) -> None:
    packed, _ = _weight(bits, size, offset, signed, seed=3)
    x = torch.randn(lowbit.KERNEL_ROWS, packed.cols, generator=torch.Generator().manual_seed(4))
    together = lowbit.matmul(x, packed)
    for i in range(x.shape[0]):
        assert torch.equal(lowbit.matmul(x[i : i + 1], packed)[0], together[i]), i


@pytest.mark.parametrize("bf16", [False, True])
def test_parts_share_one_output_and_many_rows_run_a_float_product(monkeypatch, bf16: bool) -> None:  # type: ignore[no-untyped-def]
    """Few rows of a stacked weight's parts on the kernel, into one output; more rows on the weight
    dequantised into a buffer: float32's product, or bfloat16's on CPUs with bfloat16 hardware (its
    weights rounded to nearest, as torch rounds them)."""
    monkeypatch.setattr(lowbit, "bf16_prefill", lambda: bf16)
    q, wq = _weight(4, 32, True, False, rows=40, seed=5)
    v, wv = _weight(8, 16, False, True, rows=24, seed=6)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(7))
    both = lowbit.linear(x, [q, v])
    assert torch.equal(both, torch.cat([lowbit.matmul(x, q), lowbit.matmul(x, v)], -1))
    many = torch.randn(lowbit.KERNEL_ROWS + 1, 256, generator=torch.Generator().manual_seed(8))
    if bf16:
        assert torch.equal(lowbit._dequantized(q, 0, 40), wq.bfloat16())
        want = torch.cat([F.linear(many.bfloat16(), w.bfloat16()).float() for w in (wq, wv)], -1)
    else:
        want = torch.cat([F.linear(many, wq), F.linear(many, wv)], -1)
    assert torch.equal(lowbit.linear(many, [q, v]), want)


@pytest.mark.parametrize("kind", sorted(groups.BLOCKS))
def test_a_ggufs_blocks_pack_and_dequantise_as_gguf_does(kind: str) -> None:
    from gguf import GGMLQuantizationType, dequantize

    per = groups.BLOCKS[kind][1]
    rows, cols = 6, 2 * per if per == 256 else 4 * per
    raw = random_blocks(kind, rows, cols, seed=5)
    g = groups.from_blocks(kind, raw, rows, cols)
    assert g is not None
    packed = lowbit.from_groups(g)
    assert packed.bits == (4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols).astype(np.float32))
    assert torch.equal(packed.dequantize(), want)
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(9))
    got = lowbit.matmul(x, packed).double()
    assert float((got - _rounded_oracle(x, want)).abs().max() / got.abs().max()) < 1e-5


QUANT = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_down": "Q5_1", "*": "Q4_0"}


@pytest.mark.parametrize("family", FAMILIES)
def test_lowbit_holds_a_ggufs_blocks_at_their_bits(tmp_path, monkeypatch, family: str) -> None:  # type: ignore[no-untyped-def]
    """Every linear (and a tied table) in the file's own blocks, 4-bit ones at 4 bits, dequantising to
    fp32's weights bit for bit, and never read as floats; a prefill is fp32's products of those weights
    (to float32's rounding), a few rows' logits are close to fp32's, and a batched decoding step equals
    its rows stepped alone."""
    from kvfuse.gguffile import GGUFTensors

    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path / "cache"))
    file = tmp_path / f"{family}.gguf"
    write_tiny_gguf(file, family, quant=QUANT)
    root = resolve_model_path(file)
    monkeypatch.setattr(lowbit, "bf16_prefill", lambda: False)  # float32 prefills (bfloat16's: below)
    floats: list[str] = []
    real_float = GGUFTensors.float

    def spy(self: GGUFTensors, name: str, rows: slice | None = None) -> torch.Tensor:
        floats.append(name)
        return real_float(self, name, rows)

    monkeypatch.setattr(GGUFTensors, "float", spy)
    loaded = load_model(root, "lowbit")
    assert floats and all(n.endswith(("norm.weight", ".bias")) for n in floats), floats  # no weight's float copy
    monkeypatch.undo()
    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(lowbit, "bf16_prefill", lambda: False)
    fp32 = load_model(root, "fp32")
    model = loaded.model
    assert precision.of(model) == "lowbit" and loaded.fingerprint == fp32.fingerprint + precision.TAGS["lowbit"]
    linears = {n: m for n, m in model.named_modules() if isinstance(m, lowbit.LowBitLinear)}
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    qkv = linears["layers.0.self_attn.qkv_proj"]
    assert [p.bits for p in qkv.parts] == [4, 4, 8]  # Q4_0 and Q4_1 stay 4-bit, Q8_0 is 8-bit
    fp_state = fp32.model.state_dict()
    for name, lin in linears.items():
        assert torch.equal(lin.dequantize(), fp_state[f"{name}.weight"]), name
    ids = torch.tensor([5, 77, 200, 9, 33, 100, 4, 250, 17, 64] * 3)
    with torch.inference_mode():
        many, want_many = model(ids), fp32.model(ids)  # more rows than the kernel takes: float32 products
        few, want = model(ids[:6]), fp32.model(ids[:6])
    # the same weights in float32 (F.linear, where fp32 runs oneDNN's packed kernel: sums may round apart)
    assert float((many - want_many).abs().max() / want_many.abs().max()) < 1e-5
    assert float(kl_divergence(want[-1], few[-1])) < 1e-3
    with torch.inference_mode():
        assert batch_limit(model, 6) == 6
    assert model.kv_dtype == torch.float32
    monkeypatch.setattr(lowbit, "bf16_prefill", lambda: True)  # bfloat16 prefills: keys and values too
    assert load_model(root, "lowbit").model.kv_dtype == torch.bfloat16


def test_a_second_load_maps_the_converted_model(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The first load packs the GGUF's blocks and keeps the converted model beside the checkpoint; the
    next maps it without reading a block, and computes the same."""
    from kvfuse import converted
    from kvfuse.gguffile import GGUFTensors

    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path / "cache"))
    file = tmp_path / "llama.gguf"
    write_tiny_gguf(file, "llama", quant=QUANT)
    root = resolve_model_path(file)
    first = load_model(root, "lowbit")
    assert converted.file_for(root).is_file()

    def no_blocks(*args: object) -> None:
        raise AssertionError("read the GGUF's blocks again")

    monkeypatch.setattr(GGUFTensors, "groups", no_blocks)
    second = load_model(root, "lowbit")
    assert second.fingerprint == first.fingerprint and precision.of(second.model) == "lowbit"
    ids = torch.tensor([5, 77, 200, 9, 33, 100, 4, 250, 17, 64] * 3)
    with torch.inference_mode():
        for n in (4, 30):  # the kernel's rows, and a prefill's
            assert torch.equal(second.model(ids[:n]), first.model(ids[:n]))
    monkeypatch.setattr(converted, "LAYOUT", converted.LAYOUT + 1)  # another layout: packed again
    with pytest.raises(AssertionError, match="blocks again"):
        load_model(root, "lowbit")
