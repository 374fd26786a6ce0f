from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import FAMILIES, make_checkpoint  # noqa: E402

MUSIQUE = Path(__file__).resolve().parents[1] / "data" / "musique_dev.json"  # in the repository (data/README.md)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """family -> (checkpoint dir, the HF reference model) for tiny random configs."""
    out = {}
    for fam in FAMILIES:
        root = tmp_path_factory.mktemp(fam)
        out[fam] = (root, make_checkpoint(fam, root))
    return out


@pytest.fixture(scope="session")
def tiny_engines(tiny_models):  # type: ignore[no-untyped-def]
    from kvfuse.engine import Engine
    from kvfuse.weights import load_model

    engines = {}
    for fam, (root, _) in tiny_models.items():
        lm = load_model(root)
        engines[fam] = Engine(lm.model, lm.fingerprint)
    return engines


@pytest.fixture(scope="session")
def engine_at(tiny_models):  # type: ignore[no-untyped-def]
    """engine_at(family, precision): a tiny engine at that precision (fp32, bf16, int8), built once."""
    from kvfuse.engine import Engine
    from kvfuse.weights import load_model

    built: dict[tuple[str, str], Engine] = {}

    def get(family: str, precision: str) -> Engine:
        if (family, precision) not in built:
            lm = load_model(tiny_models[family][0], precision)
            built[family, precision] = Engine(lm.model, lm.fingerprint)
        return built[family, precision]

    return get


def hf_reference(path: Path) -> torch.nn.Module:
    """transformers' own model of a checkpoint, in float32: read from its GGUF where it has one (the
    oracle for our GGUF reading and model), else from its safetensors."""
    from transformers import AutoModelForCausalLM

    from kvfuse.checkpoints import gguf_of

    gguf = gguf_of(path)
    if gguf is None:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


def rand_ids(n: int, seed: int, vocab: int = 128, low: int = 3) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(int(x) for x in torch.randint(low, vocab, (n,), generator=g))


@pytest.fixture(scope="session")
def real_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One KV store for the slow tests on the real model, so the Albarán prefix is built once."""
    return tmp_path_factory.mktemp("real-store")
