"""A knowledge base served by CAG: one cached prefix per access group (and tenant), answered from.

`KnowledgeBase` holds what the answer pipeline needs (the engine, the tokenizer, the manifest, the
plans of its groups, its state dir and usage) and the edits. Building is `kb/build.py`; answering is
`kb/answer.py`, which the CLI, the demo and the server all call; the methods here are shorthands.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvfuse.engine import Engine
from kvfuse.kb import answer as pipeline
from kvfuse.kb.build import BuildReport, build, needs_build, stored_tokens, unpin_obsolete
from kvfuse.kb.cost import CostModel
from kvfuse.kb.manifest import (
    Document,
    KBError,
    Manifest,
    delete_document,
    load_manifest,
    put_document,
    with_document,
)
from kvfuse.kb.prefix import PrefixPlan, plan_prefix
from kvfuse.kb.usage import Usage
from kvfuse.rag.index import IndexChunk
from kvfuse.request import Ratio
from kvfuse.text.tokenizer import Tokenizer


class KnowledgeBase:
    def __init__(self, engine: Engine, tok: Tokenizer, manifest: Manifest, state_dir: Path | None = None,
                 costs: CostModel | None = None) -> None:
        self.engine, self.tok, self.manifest = engine, tok, manifest
        self.state_dir = state_dir
        self.costs = costs or CostModel()
        self.usage_log = Usage(state_dir, manifest.name)
        self._plans: dict[tuple[str, str | None], tuple[Manifest, PrefixPlan]] = {}
        self._lock = threading.Lock()
        self.records: dict[tuple[str, str | None], dict[str, Any]] = {}  # build records, without a state dir
        self._read: dict[tuple[str, str | None], float] = {}  # prefixes requests read, and when last

    def note_read(self, group: str, tenant: str | None) -> None:
        """A request read this prefix (an edit rebuilds the prefixes read, `read_prefixes`)."""
        with self._lock:
            self._read[(group, tenant or None)] = time.monotonic()

    def read_prefixes(self, groups: Sequence[str] | None = None) -> list[tuple[str, str | None]]:
        """The (group, tenant) prefixes requests have read since this process started, most recent first
        (only those of `groups`, if given)."""
        with self._lock:
            read = sorted(self._read.items(), key=lambda kv: -kv[1])
        return [k for k, _ in read if groups is None or k[0] in groups]

    @classmethod
    def open(cls, path: str | Path, engine: Engine, tok: Tokenizer, state_dir: Path | None = None,
             costs: CostModel | None = None) -> KnowledgeBase:
        return cls(engine, tok, load_manifest(path), state_dir, costs)

    @property
    def name(self) -> str:
        return self.manifest.name

    def default_group(self) -> str:
        """Least privilege: the group that may read the fewest documents."""
        return self.manifest.default_group()

    def plan(self, group: str, tenant: str | None = None) -> PrefixPlan:
        """The group's prefix for the current manifest (the same object until an edit; safe to call while
        another thread edits)."""
        key = (group, tenant or None)
        with self._lock:
            manifest = self.manifest
            cached = self._plans.get(key)
            if cached is not None and cached[0] is manifest:
                return cached[1]
        plan = plan_prefix(manifest, self.tok, group, tenant or None)
        with self._lock:
            if self.manifest is manifest:
                self._plans[key] = (manifest, plan)
        return plan

    def check_length(self, plan: PrefixPlan, extra: int = 0) -> None:
        """The prefix, and `extra` tokens of the request, must fit the model's window."""
        limit = self.engine.cfg.max_position_embeddings
        if len(plan.ids) + extra > limit:
            raise KBError(f"the {plan.group!r} prefix of {self.name!r} has {len(plan.ids)} tokens and the request "
                          f"{extra} more, but the model's window is {limit}; split the knowledge base or move "
                          "documents behind retrieval")

    # -- building ----------------------------------------------------------------------------------

    def cached_tokens(self, plan: PrefixPlan) -> int:
        return stored_tokens(self, plan)

    def build(self, group: str, tenant: str | None = None, progress: bool = False) -> BuildReport:
        return build(self, self.plan(group, tenant), progress)

    def ensure_built(self, group: str, tenant: str | None = None) -> BuildReport | None:
        """Build the group's prefix if some full block of it is not stored; None when nothing was missing."""
        plan = self.plan(group, tenant)
        return build(self, plan) if needs_build(self, plan) else None

    # -- asking ------------------------------------------------------------------------------------

    def ask(self, question: str, group: str, tenant: str | None = None, chunks: Sequence[IndexChunk] = (),
            ratio: Ratio = None, max_tokens: int = pipeline.ANSWER_TOKENS, quote: bool = True) -> pipeline.Answer:
        return pipeline.ask(self, question, group, tenant, chunks, ratio, max_tokens, quote)

    def usage(self) -> dict[str, Any]:
        return self.usage_log.read()

    # -- edits -------------------------------------------------------------------------------------

    def put_document(self, doc: Document) -> None:
        """Add or replace a document; refused before anything is written if a group's prefix would not fit."""
        new = with_document(self.manifest, doc)
        for g in new.document(doc.id).groups:
            self.check_length(plan_prefix(new, self.tok, g))
        self._swap(put_document(self.manifest, doc))

    def delete_document(self, doc_id: str) -> None:
        self._swap(delete_document(self.manifest, doc_id))

    def reload(self) -> None:
        self._swap(load_manifest(self.manifest.root))

    def _swap(self, manifest: Manifest) -> None:
        """The edited manifest, in effect at once; every tenant's blocks it made obsolete are unpinned."""
        with self._lock:
            self.manifest = manifest
            self._plans.clear()
        unpin_obsolete(self)
