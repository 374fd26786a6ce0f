"""The engine away from the CPU: caches move between host and device, RoPE follows its positions, and
(where an accelerator exists) a tiny engine on it answers like the CPU's. The CPU tests use torch's
"meta" device, which has shapes and a device but no data, as the other device."""

import pytest
import torch
from conftest import rand_ids

from kvfuse.config import RopeSpec
from kvfuse.engine import Engine, Request
from kvfuse.engine.sampling import SamplingParams
from kvfuse.kv import HOST, KVCache, Residual
from kvfuse.loader import OnDevice, on_device
from kvfuse.rope import inv_freq, rope_cos_sin
from kvfuse.weights import load_model

META = torch.device("meta")
GREEDY = SamplingParams(max_tokens=6)


def _cache(n: int = 5) -> KVCache:
    k = torch.randn(3, 2, n, 4)
    return KVCache(k, torch.randn_like(k), torch.arange(10, 10 + n), Residual(1, torch.randn(n, 8)))


def test_kvcache_to_moves_every_tensor_and_keeps_what_is_already_there() -> None:
    c = _cache()
    assert c.to() is c and c.to(torch.float32, HOST) is c
    moved = c.to(device=META)
    assert moved.device == META and moved.positions.device == META
    assert moved.residual is not None and moved.residual.hidden.device == META
    assert moved.k.dtype == torch.float32 and moved.k.shape == c.k.shape
    half = c.to(torch.bfloat16)
    assert half.k.dtype == half.v.dtype == torch.bfloat16 and half.positions.device == HOST
    assert half.residual is not None and half.residual.hidden.dtype == torch.bfloat16


def test_on_device_reads_layers_onto_the_device() -> None:
    c = _cache()
    assert on_device(c, HOST) is c  # already there: read as it is
    src = on_device(c, META)
    assert isinstance(src, OnDevice)
    assert src.positions.device == META and len(src) == len(c) and src.nbytes == c.nbytes
    k, v = src.layer(2)
    assert k.device == v.device == META and k.shape == c.k[2].shape
    hidden = src.residual_at(1)
    assert hidden is not None and hidden.device == META and hidden.shape == (5, 8)
    assert src.residual_at(2) is None


def test_rope_follows_its_positions_device() -> None:
    spec = RopeSpec(base=10000.0)
    cos, sin = rope_cos_sin(torch.arange(7), 16, spec)
    assert cos.device == HOST and cos.shape == (7, 16)
    assert inv_freq(16, spec) is inv_freq(16, spec)  # cached on the CPU
    mcos, msin = rope_cos_sin(torch.arange(7, device=META), 16, spec)
    assert mcos.device == msin.device == META and mcos.shape == cos.shape
    assert inv_freq(16, spec).device == HOST  # the device's copy did not replace the CPU's


def test_int8_is_refused_off_the_cpu(tiny_models) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="CPU only"):
        load_model(tiny_models["llama"][0], "int8", "cuda")


@pytest.mark.parametrize(("device", "says"), [
    ("bogus", "not a device torch knows"),
    ("meta", "holds no data"),
    pytest.param("cuda", "not available", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
    pytest.param("cuda:99", "numbered from 0",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
])
def test_a_device_that_cannot_run_is_refused_before_loading(tiny_models, device: str, says: str) -> None:  # type: ignore[no-untyped-def]
    from kvfuse.config import UnsupportedDeviceError
    from kvfuse.weights import check_device

    assert check_device("cpu") == HOST
    with pytest.raises(UnsupportedDeviceError, match=says):
        check_device(device)
    with pytest.raises(UnsupportedDeviceError, match=says):
        load_model(tiny_models["llama"][0], device=device)


def test_the_cli_names_a_bad_device_and_loads_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`--device` on every command that loads a model: one it cannot use is a one-line error, before a
    model is resolved (a missing --model directory would otherwise be the error)."""
    from kvfuse.cli.main import main

    (tmp_path / "c.txt").write_text("a chunk")
    for argv in (["generate", "--chunk-file", str(tmp_path / "c.txt"), "--question", "q"],
                 ["serve", "--store", str(tmp_path / "s")], ["calibrate", "--cases", "2"]):
        with pytest.raises(SystemExit, match="kvfuse: device 'bogus' is not a device torch knows"):
            main([*argv, "--model", str(tmp_path / "no-model"), "--device", "bogus"])
    with pytest.raises(SystemExit, match="int8 runs on the CPU only"):
        main(["generate", "--chunk-file", str(tmp_path / "c.txt"), "--question", "q", "--precision", "int8",
              "--device", "cuda"])
    # an unknown mode is named with the registered ones, before a model is resolved
    with pytest.raises(SystemExit, match="kvfuse: unknown mode 'bogus'; choose one of full, prefix"):
        main(["generate", "--chunk-file", str(tmp_path / "c.txt"), "--question", "q", "--mode", "bogus",
              "--model", str(tmp_path / "no-model")])


def test_each_device_type_has_its_own_profile(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvfuse.profile import profile_path

    cpu = profile_path(tmp_path, "f" * 64)
    assert cpu == profile_path(tmp_path, "f" * 64, torch.device("cpu"))
    assert cpu.name.endswith(".json") and "-cuda" not in cpu.name
    gpu = profile_path(tmp_path, "f" * 64, torch.device("cuda"))
    assert gpu != cpu and gpu.name.endswith("-cuda.json")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_an_engine_on_cuda_answers_like_the_cpu(tiny_models, family: str) -> None:  # type: ignore[no-untyped-def]
    req = Request(prefix=(1,) + rand_ids(11, 0), chunks=(rand_ids(13, 1), rand_ids(9, 2)), suffix=rand_ids(4, 3))
    cpu_lm = load_model(tiny_models[family][0])
    cpu = Engine(cpu_lm.model, cpu_lm.fingerprint).generate(req, "full", params=GREEDY)
    lm = load_model(tiny_models[family][0], device="cuda")
    e = Engine(lm.model, lm.fingerprint)
    assert e.blend_error is None
    full = e.generate(req, "full", params=GREEDY)
    assert full.tokens == cpu.tokens
    for mode, ratio in (("prefix", None), ("blend", 1.0), ("queryaware", 1.0)):
        e.precompute(req, mode)
        out = e.generate(req, mode, ratio, GREEDY)
        assert out.tokens == full.tokens, mode
    assert all(c.k.device == HOST for c in (e.store.get(k) for k in e.store.tiers[0].keys()) if c is not None)
