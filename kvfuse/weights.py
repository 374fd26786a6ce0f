"""Loading a local HF checkpoint (config.json + safetensors, `checkpoints.resolve_model_path`) into our
Decoder at a precision, a part at a time, on a device."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvfuse.checkpoints import BlockFile, FileRows, checkpoint_blocks, resolve_model_path
from kvfuse.config import CheckpointError, ModelConfig, UnsupportedDeviceError
from kvfuse.heap import return_freed_memory
from kvfuse.model import STACKED, Decoder, stack_checkpoint
from kvfuse.precision import DEFAULT_PRECISION, by_rows, convert_rows, load_dtype, reads_blocks
from kvfuse.precision import convert as convert_part
from kvfuse.precision import fingerprint as precision_fingerprint
from kvfuse.precision import parts as precision_parts

if TYPE_CHECKING:
    from kvfuse.groups import Groups


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Decoder
    path: Path
    fingerprint: str  # sha256 of config.json and the weight files (and the precision, if not fp32)
    precision: str = DEFAULT_PRECISION


def check_device(device: str | torch.device, precision: str = DEFAULT_PRECISION) -> torch.device:
    """The device a model would run on, checked before anything is read: torch must parse the name, have
    that backend and the device's index here, and the precision must run there (int8's kernels are x86
    CPU ones). Raises UnsupportedDeviceError saying what to use instead."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UnsupportedDeviceError(
            f"device {device!r} is not a device torch knows ({e}); use cpu, cuda or cuda:N") from None
    if dev.type == "meta":
        raise UnsupportedDeviceError("device meta holds no data; use cpu or an accelerator such as cuda")
    if dev.type == "cpu":
        return dev
    if precision in ("int8", "w8a8", "lowbit"):
        raise UnsupportedDeviceError(f"precision {precision} runs on the CPU only (x86 int8 kernels); "
                                     f"on {dev} use fp32 or bf16")
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise UnsupportedDeviceError(f"device {dev} is not available in this torch ({torch.__version__}) on this "
                                     "machine; use cpu")
    count = getattr(backend, "device_count", None)
    if dev.index is not None and count is not None and dev.index >= count():
        raise UnsupportedDeviceError(f"device {dev}: this machine has {count()} {dev.type} device(s), numbered from 0")
    return dev


def load_model(path: str | os.PathLike[str] | None = None, precision: str = DEFAULT_PRECISION,
               device: str | torch.device = "cpu") -> LoadedModel:
    """Load a local HF checkpoint (config.json + safetensors) into a Decoder in eval mode, at a precision
    (`precision.PRECISIONS`), fingerprinted with it, on a device (the CPU, or an accelerator torch
    knows: each part is moved there before it is converted, so nothing CPU-only is built for it)."""
    dtype = load_dtype(precision)
    dev = check_device(device, precision)

    root = resolve_model_path(path)
    cfg = ModelConfig.from_hf_config(json.loads((root / "config.json").read_text()))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root} has no *.safetensors weights")
    with torch.device("meta"):
        model = Decoder(cfg)
    index = _tensor_index(files)
    if cfg.tie_embeddings:
        index.pop("lm_head.weight", None)
    expected = set(model.state_dict())
    names = set(_stacked_names(index))
    missing, unexpected = expected - names, names - expected
    if missing:
        raise CheckpointError(f"{root}: missing tensors {sorted(missing)[:5]} (and {max(0, len(missing) - 5)} more)")
    if unexpected:
        raise CheckpointError(f"{root}: tensors this config does not use: {sorted(unexpected)[:5]}")
    blocks = checkpoint_blocks(root, index, cfg) if reads_blocks(precision, "embed_tokens") else None
    # one part at a time (`precision.parts`), each read from a mapping of the file that closes once the
    # part is converted: an int8 model never holds the float checkpoint's pages all at once
    for part in precision_parts(cfg):
        own = _stacked_blocks(blocks, part) if reads_blocks(precision, part) else {}
        if by_rows(cfg, part, precision):
            convert_rows(model, part, FileRows(*index[f"{part}.weight"], dtype), precision, own)
            return_freed_memory()
            continue
        state = _read_part(index, part, dtype)
        stack_checkpoint(state)
        module = model.get_submodule(part)
        module.load_state_dict({n[len(part) + 1 :]: t for n, t in state.items()}, assign=True)
        if dev.type != "cpu":
            module.to(dev)
        state.clear()  # the model holds the tensors now: converting the part frees each one it replaces
        convert_part(model, part, precision, own)
        # each part frees a float copy of every weight it converts or stacks (10-20 MB a layer of an int8
        # load, 200-300 MB in all) that glibc would otherwise keep in its heap: the peak would grow with
        # the depth, where given back after each part it stays near the largest part
        return_freed_memory()
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, path=root, fingerprint=precision_fingerprint(fingerprint(root, files), precision),
                       precision=precision)


def _stacked_blocks(blocks: BlockFile | None, part: str) -> dict[str, list[Groups]]:
    """A part's blocks under the model's names, each weight's in a list: q, k and v's (gate and up's)
    one after another under the stacked name, where all are there."""
    mine: dict[str, list[Groups]] = {}
    if blocks is not None:
        for name in blocks.names(part):
            if (g := blocks.get(name)) is not None:
                mine[name] = [g]
    for ours, theirs in STACKED.items():
        names = [f"{part}.{t}.weight" for t in theirs]
        if all(n in mine for n in names):
            mine[f"{part}.{ours}.weight"] = [g for n in names for g in mine.pop(n)]
    return mine


def _tensor_index(files: list[Path]) -> dict[str, tuple[Path, str]]:
    """Our name of every checkpoint tensor -> (its file, its name there)."""
    from safetensors import safe_open

    index = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
                index[_our_name(name)] = (f, name)
    return index


def _stacked_names(index: dict[str, tuple[Path, str]]) -> list[str]:
    """The model's names for the indexed tensors, once stacked (`stack_checkpoint`)."""
    state = {name: torch.empty(0) for name in index}  # not meta: its cat would import torch._dynamo (1.6 s)
    stack_checkpoint(state)
    return list(state)


def _read_part(index: dict[str, tuple[Path, str]], part: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one model part (`embed_tokens`, `layers.3`, ...) in dtype, as views of the mapped
    file where no conversion copies them. The file's handle is closed: the mapping lives only as long as
    those views."""
    from safetensors import safe_open

    mine = [n for n in index if n == part or n.startswith(part + ".")]
    state = {}
    for f in sorted({index[n][0] for n in mine}):
        with safe_open(str(f), framework="pt") as fh:
            for n in mine:
                if index[n][0] == f:
                    state[n] = fh.get_tensor(index[n][1]).to(dtype)
    return state


def _our_name(hf_name: str) -> str:
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if hf_name.startswith(prefix):
            return hf_name[len(prefix) :]
    return hf_name


def fingerprint(root: Path, files: list[Path]) -> str:
    """sha256 over config.json and the weights; cached next to them keyed by size and mtime."""
    stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    memo = root / ".kvfuse-fingerprint.json"
    try:
        saved = json.loads(memo.read_text())
        if saved["stamp"] == [list(s) for s in stamp]:
            return str(saved["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256((root / "config.json").read_bytes())
    for f in files:
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    digest = h.hexdigest()
    try:
        memo.write_text(json.dumps({"stamp": stamp, "sha256": digest}))
    except OSError:
        pass  # a read-only checkpoint dir just means hashing again next time
    return digest
