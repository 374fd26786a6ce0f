"""A knowledge base on disk: `kb.toml` plus the document files it names.

    name = "albaran"
    instructions = "..."
    [[documents]]
    id = "team-terms"          # letters, digits, '-', '_' and '.'
    title = "Team plan terms"
    path = "docs/team-terms.md"  # relative to the directory
    stability = 1              # lower changes less and goes earlier in the prefix
    groups = ["support", "leads"]  # the access groups that may read it
    shared = true              # optional: public, so its cache blocks are not salted per tenant

The name `albaran` anywhere a knowledge-base directory is expected means the bundled demo.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import tomllib
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

MANIFEST = "kb.toml"
BUNDLED = {"albaran": "data/albaran"}
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class KBError(ValueError):
    """The knowledge base cannot be used as given; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    title: str
    path: str
    stability: int
    groups: tuple[str, ...]
    shared: bool = False
    text: str = ""  # read from path, newlines normalised


@dataclass(frozen=True, slots=True)
class Manifest:
    root: Path
    name: str
    instructions: str
    documents: tuple[Document, ...]

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(sorted({g for d in self.documents for g in d.groups}))

    def default_group(self) -> str:
        """Least privilege: the group that may read the fewest documents."""
        return min(self.groups, key=lambda g: (len(self.readable(g)), g))

    def readable(self, group: str) -> list[Document]:
        """The documents a group may read, in prefix order: by (stability, id)."""
        if group not in self.groups:
            raise KBError(f"unknown group {group!r} in knowledge base {self.name!r}; groups: {', '.join(self.groups)}")
        return sorted((d for d in self.documents if group in d.groups), key=lambda d: (d.stability, d.id))

    def document(self, doc_id: str) -> Document:
        for d in self.documents:
            if d.id == doc_id:
                return d
        raise KBError(f"no document {doc_id!r} in knowledge base {self.name!r}")


def resolve_kb_dir(path: str | Path) -> Path:
    """A knowledge-base directory; `albaran` is the bundled demo unless a directory of that name exists here."""
    p = Path(path)
    if str(path) in BUNDLED and not (p / MANIFEST).is_file():
        return Path(str(resources.files("kvfuse").joinpath(BUNDLED[str(path)])))
    return p


def normalize_text(text: str) -> str:
    """Newlines unified, trailing spaces and surrounding blank lines dropped: the same file always serialises alike."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "\n".join(line.rstrip() for line in lines).strip("\n")


def _doc(root: Path, i: int, raw: Any) -> Document:
    where = f"{root / MANIFEST}: documents[{i}]"
    if not isinstance(raw, dict):
        raise KBError(f"{where} must be a table")
    for key in ("id", "title", "path", "stability", "groups"):
        if key not in raw:
            raise KBError(f"{where} lacks {key!r}")
    unknown = set(raw) - {"id", "title", "path", "stability", "groups", "shared"}
    if unknown:
        raise KBError(f"{where} has unknown keys {sorted(unknown)}")
    if not isinstance(raw["id"], str) or not _ID.match(raw["id"]):
        raise KBError(f"{where}: id must be 1-128 letters, digits, '.', '_' or '-', got {raw['id']!r}")
    if not isinstance(raw["stability"], int) or isinstance(raw["stability"], bool):
        raise KBError(f"{where}: stability must be an integer (lower changes less)")
    groups = raw["groups"]
    if not isinstance(groups, list) or not groups or not all(isinstance(g, str) and _ID.match(g) for g in groups):
        raise KBError(f"{where}: groups must be a non-empty list of names")
    path = root / raw["path"]
    try:
        text = normalize_text(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise KBError(f"{where}: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise KBError(f"{where}: {path} is not UTF-8 text") from None
    return Document(raw["id"], str(raw["title"]).strip(), str(raw["path"]), raw["stability"],
                    tuple(sorted(set(groups))), bool(raw.get("shared", False)), text)


def load_manifest(path: str | Path) -> Manifest:
    root = resolve_kb_dir(path)
    mf = root / MANIFEST
    try:
        raw = tomllib.loads(mf.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KBError(f"no {MANIFEST} in {root}; a knowledge base is a directory with a {MANIFEST}") from None
    except OSError as e:
        raise KBError(f"cannot read {mf}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise KBError(f"{mf} is not valid TOML: {e}") from None
    for key in ("name", "instructions"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise KBError(f"{mf} needs a non-empty {key!r} string")
    if not _ID.match(raw["name"]):
        raise KBError(f"{mf}: name must be letters, digits, '.', '_' or '-', got {raw['name']!r}")
    docs = tuple(_doc(root, i, d) for i, d in enumerate(raw.get("documents", [])))
    if not docs:
        raise KBError(f"{mf} lists no [[documents]]")
    seen: set[str] = set()
    for d in docs:
        if d.id in seen:
            raise KBError(f"{mf}: document id {d.id!r} is used twice")
        seen.add(d.id)
    return Manifest(root, raw["name"], normalize_text(raw["instructions"]), docs)


def _toml_str(s: str) -> str:
    """A TOML basic string: JSON's escapes (quotes, backslashes, control characters) are TOML's too."""
    return json.dumps(s, ensure_ascii=False)


def dump_manifest(m: Manifest) -> str:
    """The manifest as TOML (documents in prefix order)."""
    out = [f"name = {_toml_str(m.name)}", f"instructions = {_toml_str(m.instructions)}", ""]
    for d in sorted(m.documents, key=lambda d: (d.stability, d.id)):
        groups = ", ".join(_toml_str(g) for g in d.groups)
        out += ["[[documents]]", f"id = {_toml_str(d.id)}", f"title = {_toml_str(d.title)}",
                f"path = {_toml_str(d.path)}", f"stability = {d.stability}", f"groups = [{groups}]",
                f"shared = {'true' if d.shared else 'false'}", ""]
    return "\n".join(out)


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def with_document(m: Manifest, doc: Document) -> Manifest:
    """The manifest with doc added or replaced (checked, nothing written)."""
    if not _ID.match(doc.id):
        raise KBError(f"document id must be 1-128 letters, digits, '.', '_' or '-', got {doc.id!r}")
    if not doc.groups or not all(_ID.match(g) for g in doc.groups):
        raise KBError(f"a document needs one or more groups named with letters, digits, '.', '_' or '-', "
                      f"got {list(doc.groups)}")
    if any(ord(ch) < 32 for ch in doc.title) or not doc.title.strip():
        raise KBError("a document title must be non-empty, on one line, without control characters")
    if not doc.text.strip():
        raise KBError(f"document {doc.id!r} is empty")
    rel = doc.path or f"docs/{doc.id}.md"
    target = (m.root / rel).resolve()
    if m.root.resolve() not in target.parents:
        raise KBError(f"document path {rel!r} must stay inside the knowledge base directory")
    doc = replace(doc, path=rel, text=normalize_text(doc.text))
    return replace(m, documents=tuple(d for d in m.documents if d.id != doc.id) + (doc,))


def put_document(m: Manifest, doc: Document) -> Manifest:
    """Add or replace a document: its file is written first, then the manifest, each atomically."""
    new = with_document(m, doc)
    saved = new.document(doc.id)
    _atomic_write((m.root / saved.path).resolve(), saved.text + "\n")
    _atomic_write(m.root / MANIFEST, dump_manifest(new))
    return new


def delete_document(m: Manifest, doc_id: str) -> Manifest:
    """Remove a document from the manifest (its file is kept, so nothing is lost by mistake)."""
    m.document(doc_id)
    docs = tuple(d for d in m.documents if d.id != doc_id)
    if not docs:
        raise KBError("cannot delete the last document of a knowledge base")
    new = replace(m, documents=docs)
    _atomic_write(m.root / MANIFEST, dump_manifest(new))
    return new
