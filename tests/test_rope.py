import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfuse.config import RopeSpec
from kvfuse.rope import apply_rope, inv_freq, rerotate, rope_cos_sin, rotate, signed_sin

SPECS = {
    "default": RopeSpec(base=10000.0),
    "linear": RopeSpec(base=10000.0, kind="linear", factor=4.0),
    "llama3": RopeSpec(base=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position=64),
}


def _hf_params(spec: RopeSpec) -> dict:
    p = {"rope_type": spec.kind, "rope_theta": spec.base}
    if spec.kind != "default":
        p["factor"] = spec.factor
    if spec.kind == "llama3":
        p.update(low_freq_factor=spec.low_freq_factor, high_freq_factor=spec.high_freq_factor,
                 original_max_position_embeddings=spec.original_max_position)
    return p


@pytest.mark.parametrize("kind", list(SPECS))
def test_cos_sin_and_apply_match_hf(kind: str) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    spec = SPECS[kind]
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=512,
                      rope_parameters=_hf_params(spec))
    hf_rope = LlamaRotaryEmbedding(cfg)
    pos = torch.arange(0, 300, 7)
    x = torch.randn(1, 2, len(pos), 32)
    hf_cos, hf_sin = hf_rope(x, pos[None])
    cos, sin = rope_cos_sin(pos, 32, spec)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)
    hf_q, _ = apply_rotary_pos_emb(x, x, hf_cos, hf_sin)
    torch.testing.assert_close(apply_rope(x, cos, sin), hf_q, rtol=0, atol=1e-6)


def test_llama3_scaling_changes_low_frequencies_only() -> None:
    plain, scaled = inv_freq(32, RopeSpec(base=500000.0)), inv_freq(32, SPECS["llama3"])
    assert torch.equal(plain[:2], scaled[:2])  # high frequencies kept
    assert torch.allclose(scaled[-1], plain[-1] / 8.0)  # the lowest is divided by factor


@settings(max_examples=40, deadline=None)
@given(a=st.integers(0, 4000), b=st.integers(0, 4000), kind=st.sampled_from(list(SPECS)))
def test_rerotate_equals_computing_at_target(a: int, b: int, kind: str) -> None:
    spec = SPECS[kind]
    k = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(a ^ b))
    at_a = apply_rope(k, *rope_cos_sin(torch.tensor([a, a + 1, a + 5]), 32, spec))
    at_b = apply_rope(k, *rope_cos_sin(torch.tensor([b, b + 1, b + 5]), 32, spec))
    moved = rerotate(at_a, torch.tensor([a, a + 1, a + 5]), torch.tensor([b, b + 1, b + 5]), 32, spec)
    torch.testing.assert_close(moved, at_b, rtol=0, atol=1e-5 + 2e-7 * (a + b + abs(b - a) + 10))


@settings(max_examples=40, deadline=None)
@given(a=st.integers(-2000, 2000), b=st.integers(-2000, 2000), kind=st.sampled_from(list(SPECS)))
def test_rotations_compose(a: int, b: int, kind: str) -> None:
    spec = SPECS[kind]
    x = torch.randn(4, 5, 32, generator=torch.Generator().manual_seed(7))
    zero = torch.zeros(5, dtype=torch.int64)
    twice = rerotate(rerotate(x, zero, zero + a, 32, spec), zero, zero + b, 32, spec)
    once = rerotate(x, zero, zero + a + b, 32, spec)
    # angles are float32 (as in HF), so their error grows with the position: ~1e-7 rad per unit
    tol = 1e-5 + 2e-7 * (abs(a) + abs(b) + abs(a + b))
    torch.testing.assert_close(twice, once, rtol=0, atol=tol)


def test_rerotate_zero_shift_is_identity_and_norm_preserving() -> None:
    x = torch.randn(2, 6, 32)
    pos = torch.arange(6)
    assert rerotate(x, pos, pos, 32, SPECS["default"]) is x
    moved = rerotate(x, pos, pos + 100, 32, SPECS["default"])
    torch.testing.assert_close(moved.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(moved, x)


@settings(max_examples=30, deadline=None)
@given(shift=st.integers(-400, 400), jitter=st.booleans(), kind=st.sampled_from(list(SPECS)),
       bf16=st.booleans())
def test_rerotate_into_writes_what_rerotate_returns(shift: int, jitter: bool, kind: str, bf16: bool) -> None:
    from kvfuse.rope import rerotate_into

    g = torch.Generator().manual_seed(shift + 1000)
    k = torch.randn(2, 13, 32, generator=g)
    k = k.to(torch.bfloat16) if bf16 else k
    src = torch.arange(1, 14)
    dst = src + 500 + shift
    if jitter:  # not one shift for the whole chunk
        dst = dst + torch.randint(0, 5, (13,), generator=g)
    out = torch.full((2, 13, 32), float("nan"))
    rerotate_into(out, k, src, dst, 32, SPECS[kind])
    want = rerotate(k.float(), src, dst, 32, SPECS[kind])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_with_a_signed_sin_is_apply_rope_bit_for_bit(dtype: torch.dtype) -> None:
    """The layers rotate q and k with `rotate` (the halves swapped times a sin whose first half is
    negated); every other caller and the cached keys use `apply_rope`: the two must agree exactly."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 9, 32, generator=g) * 5).to(dtype)
    pos = torch.tensor([0, 1, 2, 7, 100, 4095, 4096, 10_000, 131_071])
    cos, sin = rope_cos_sin(pos, 32, RopeSpec(base=10000.0))
    assert torch.equal(rotate(x, cos, signed_sin(sin)), apply_rope(x, cos, sin))
    assert torch.equal(rotate(x.transpose(0, 1), cos[:, None], signed_sin(sin)[:, None]),
                       apply_rope(x.transpose(0, 1), cos[:, None], sin[:, None]))  # strided, as a layer's q
