"""Loading a local HF checkpoint (config.json + safetensors, `checkpoints.resolve_model_path`) into our
Decoder at a precision, a part at a time, on a device."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from kvfuse import converted
from kvfuse.checkpoints import FileRows, resolve_model_path
from kvfuse.config import CheckpointError, ModelConfig, UnsupportedDeviceError
from kvfuse.heap import return_freed_memory
from kvfuse.model import STACKED, Decoder, stack_checkpoint
from kvfuse.precision import DEFAULT_PRECISION, by_rows, convert_rows, load_dtype, reads_blocks
from kvfuse.precision import convert as convert_part
from kvfuse.precision import fingerprint as precision_fingerprint
from kvfuse.precision import parts as precision_parts

if TYPE_CHECKING:
    from kvfuse.groups import Groups
    from kvfuse.quant import Rows


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
    """Load a checkpoint (a GGUF's, read as it is, or a local HF one: config.json + safetensors) into a
    Decoder in eval mode, at a precision (`precision.PRECISIONS`), fingerprinted with it, on a device
    (the CPU, or an accelerator torch knows: each part is moved there before it is converted, so nothing
    CPU-only is built for it). One part is read at a time: the peak is the loaded model and one part."""
    dtype = load_dtype(precision)
    dev = check_device(device, precision)

    root = resolve_model_path(path)
    cfg = ModelConfig.from_hf_config(json.loads((root / "config.json").read_text()))
    with torch.device("meta"):
        model = Decoder(cfg)
    source = open_source(root, cfg, list(model.state_dict()))
    names = source.names()
    if cfg.tie_embeddings and "lm_head.weight" in names:
        names.remove("lm_head.weight")
    expected = set(model.state_dict())
    stacked = set(_stacked_names(names))
    missing, unexpected = expected - stacked, stacked - expected
    if missing:
        raise CheckpointError(f"{root}: missing tensors {sorted(missing)[:5]} (and {max(0, len(missing) - 5)} more)")
    if unexpected:
        raise CheckpointError(f"{root}: tensors this config does not use: {sorted(unexpected)[:5]}")
    fp = precision_fingerprint(source.fingerprint(), precision)
    keeps = precision == "lowbit" and isinstance(source, GGUFSource)  # its packing is kept (`converted`)
    if keeps and (kept := converted.load(root, cfg, fp)) is not None:
        return LoadedModel(model=kept, path=root, fingerprint=fp, precision=precision)
    for part in precision_parts(cfg):
        own = _stacked_blocks(source, part) if reads_blocks(precision, part) else {}
        if by_rows(cfg, part, precision):
            convert_rows(model, part, source.rows(f"{part}.weight", dtype), precision, own)
            return_freed_memory()
            continue
        state = source.read_part(part, dtype, skip=set(own) if precision in ("groups", "lowbit") else set())
        stack_checkpoint(state)
        module = model.get_submodule(part)
        # weights held as their blocks are not read as floats: their linears stay on the meta device until converted
        module.load_state_dict({n[len(part) + 1 :]: t for n, t in state.items()}, assign=True, strict=not own)
        if dev.type != "cpu":
            module.to(dev)
        state.clear()  # the model holds the tensors now: converting the part frees each one it replaces
        convert_part(model, part, precision, own)
        # each part frees a float copy of every weight it converts or stacks (10-20 MB a layer of an int8
        # load, 200-300 MB in all) that glibc would otherwise keep in its heap: the peak would grow with
        # the depth, where given back after each part it stays near the largest part
        return_freed_memory()
    model.eval().requires_grad_(False)
    if keeps:
        converted.save(model, root, fp)
    return LoadedModel(model=model, path=root, fingerprint=fp, precision=precision)


class Source(Protocol):
    """Where a checkpoint's tensors are read from, under our names (unstacked), a part at a time."""

    def names(self) -> list[str]: ...

    def read_part(self, part: str, dtype: torch.dtype, skip: set[str]) -> dict[str, torch.Tensor]:
        """The tensors of one model part (`embed_tokens`, `layers.3`, ...) in dtype, but those in skip
        (weights the precision builds from their blocks: stacked names skip their parts)."""
        ...

    def rows(self, name: str, dtype: torch.dtype) -> Rows: ...

    def blocks(self, name: str) -> Groups | None:
        """A weight's own quantised blocks, where the checkpoint holds them."""
        ...

    def fingerprint(self) -> str: ...


def open_source(root: Path, cfg: ModelConfig, stacked_names: list[str]) -> Source:
    """A GGUF's checkpoint (`checkpoints.gguf_of`) reads the GGUF itself; any other reads its safetensors."""
    from kvfuse.checkpoints import gguf_of

    gguf = gguf_of(root)
    if gguf is not None:
        return GGUFSource(root, gguf, cfg, _unstacked(stacked_names))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root} has no *.safetensors weights")
    return SafetensorsSource(root, files)


def _unstacked(names: list[str]) -> list[str]:
    """The checkpoint's names of the model's stacked weights (q, k and v's for qkv_proj; its lm_head too)."""
    out = ["lm_head.weight"]
    for n in names:
        for ours, theirs in STACKED.items():
            if f".{ours}." in n:
                out += [n.replace(ours, t) for t in theirs]
                break
        else:
            out.append(n)
    return out


def _skipped(name: str, skip: set[str]) -> bool:
    for ours, theirs in STACKED.items():
        for t in theirs:
            if f".{t}." in name and name.replace(t, ours) in skip:
                return True
    return name in skip


class SafetensorsSource:
    """A local HF checkpoint's safetensors files (no blocks)."""

    def __init__(self, root: Path, files: list[Path]) -> None:
        self.root, self.files = root, files
        self.index = _tensor_index(files)

    def names(self) -> list[str]:
        return list(self.index)

    def read_part(self, part: str, dtype: torch.dtype, skip: set[str]) -> dict[str, torch.Tensor]:
        return _read_part(self.index, part, dtype)

    def rows(self, name: str, dtype: torch.dtype) -> Rows:
        return FileRows(*self.index[name], dtype)

    def blocks(self, name: str) -> Groups | None:
        return None

    def fingerprint(self) -> str:
        return fingerprint(self.root, self.files)


class GGUFSource:
    """A GGUF read as it is (`gguffile.GGUFTensors`): floats dequantised a tensor at a time, blocks as
    groups; fingerprinted by its config and the GGUF's content key."""

    def __init__(self, root: Path, file: Path, cfg: ModelConfig, names: list[str]) -> None:
        from kvfuse.gguffile import GGUFTensors

        self.root, self.file = root, file
        self.tensors = GGUFTensors(file, cfg, names)

    def names(self) -> list[str]:
        return self.tensors.names()

    def read_part(self, part: str, dtype: torch.dtype, skip: set[str]) -> dict[str, torch.Tensor]:
        mine = [n for n in self.tensors.names() if (n == part or n.startswith(part + ".")) and not _skipped(n, skip)]
        return {n: self.tensors.float(n).to(dtype) for n in mine}

    def rows(self, name: str, dtype: torch.dtype) -> Rows:
        from kvfuse.gguffile import GGUFRows

        return GGUFRows(self.tensors, name)

    def blocks(self, name: str) -> Groups | None:
        return self.tensors.groups(name) if name in self.tensors.tensors else None

    def fingerprint(self) -> str:
        from kvfuse.checkpoints import gguf_key

        config = (self.root / "config.json").read_bytes()
        return hashlib.sha256(config + b"gguf:" + gguf_key(self.file).encode()).hexdigest()


def _stacked_blocks(source: Source, part: str) -> dict[str, list[Groups]]:
    """A part's blocks under the model's names, each weight's in a list: q, k and v's (gate and up's)
    one after another under the stacked name, where all are there."""
    mine: dict[str, list[Groups]] = {}
    for name in source.names():
        if (name == f"{part}.weight" or name.startswith(part + ".")) and name.endswith(".weight"):
            if (g := source.blocks(name)) is not None:
                mine[name] = [g]
    for ours, theirs in STACKED.items():
        names = [f"{part}.{t}.weight" for t in theirs]
        if all(n in mine for n in names):
            mine[f"{part}.{ours}.weight"] = [g for n in names for g in mine.pop(n)]
        else:
            for n in names:
                mine.pop(n, None)  # a stacked weight is built from its blocks whole or not at all
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


def _stacked_names(names: list[str]) -> list[str]:
    """The model's names for the checkpoint's tensors, once stacked (`stack_checkpoint`)."""
    state = {name: torch.empty(0) for name in names}  # not meta: its cat would import torch._dynamo (1.6 s)
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
