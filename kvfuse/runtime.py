"""What the CLI, the demo and the server share to get going: where the store is, opening an engine and
its tokenizer, the loading controller, and opening a knowledge base. Imported by the edges only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfuse.engine.core import Engine
    from kvfuse.kb.base import KnowledgeBase
    from kvfuse.store.base import Remote
    from kvfuse.text.tokenizer import Tokenizer

KV_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_FLOOR = 0.15


def store_dir(store: str | Path | None, no_store: bool = False) -> Path | None:
    """The KV store directory: the one given, else `<cache dir>/store`; None keeps caches in memory."""
    from kvfuse.checkpoints import cache_dir

    if no_store:
        return None
    return Path(store) if store else cache_dir() / "store"


@dataclass(slots=True)
class Opened:
    engine: Engine
    tok: Tokenizer
    model_path: Path
    model_id: str  # what clients name it: the packaged name, the checkpoint dir's or the GGUF file's name


def open_engine(model: str | None, store: str | Path | None, kv_dtype: str = "auto",
                precision: str = "fp32", capacity: dict[str, int] | None = None,
                remote: Remote | None = None, device: str = "cpu", decodes: str = "many") -> Opened:
    """Load the checkpoint (default: Gemma 3 270M) at a precision on a device (`weights.check_device`),
    with its store (and a shared Redis tier at `remote`) and tokenizer (`decodes`: as `Engine.load`)."""
    import torch

    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.engine.core import Engine
    from kvfuse.text.tokenizer import Tokenizer
    from kvfuse.weights import check_device

    check_device(device, precision)  # a device that cannot run is refused before anything is read
    path = Path(resolve_model_path(model))
    kv = None if kv_dtype == "auto" else getattr(torch, KV_DTYPES[kv_dtype])  # auto: the precision's own dtype
    tok = Tokenizer(path)  # first: parsing its file takes a few hundred MB for a moment, before the weights are in
    engine = Engine.load(path, store_dir=store, precision=precision, capacity=capacity, remote=remote, kv_dtype=kv,
                         device=device, decodes=decodes)
    gguf = model is not None and Path(model).suffix.lower() == ".gguf"
    return Opened(engine, tok, path, Path(str(model)).stem if gguf else path.name)


def attach_controller(engine: Engine, store: Path | None, measure: bool = True, floor: float = DEFAULT_FLOOR,
                      costs: dict[str, float] | None = None) -> None:
    """Give the engine a controller from the saved profile (measuring one first if `measure`: blend
    requests always get one, so their results say what the controller predicted), with the model's
    calibrated floors where `kvfuse calibrate` measured them."""
    from kvfuse.checkpoints import cache_dir
    from kvfuse.policy import Controller
    from kvfuse.profile import load_calibration, load_or_profile, profile_path

    if not measure and not profile_path(cache_dir(), engine.fingerprint, engine.model.device).is_file():
        return
    calibration = load_calibration(cache_dir(), engine.fingerprint)  # `kvfuse calibrate`'s floors, if measured
    engine.controller = Controller(load_or_profile(engine, cache_dir(), store, costs=costs), floor, calibration)


def open_kb(path: str, opened: Opened, store: str | Path | None) -> KnowledgeBase:
    from kvfuse.kb.base import KnowledgeBase

    return KnowledgeBase.open(path, opened.engine, opened.tok, state_dir=Path(store) if store is not None else None)


def bundled(src: str) -> str:
    """The bundled data set of that name (albaran-tickets), or the path as given."""
    from importlib import resources

    if src == "albaran-tickets" and not Path(src).exists():
        return str(resources.files("kvfuse").joinpath("data/albaran-tickets"))
    return src
