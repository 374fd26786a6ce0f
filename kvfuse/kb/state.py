"""What a knowledge base is, as the pipeline reads it: the engine, the tokenizer, the manifest, the plans
of its groups (one per group and tenant, the same object until an edit), its state dir, its usage and
the prefixes requests read. The pipeline (`build`, `answer`, `conflicts`) takes a `KBState`;
`base.KnowledgeBase` adds the shorthands and the edits on top, so nothing here imports the pipeline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvfuse.engine.core import Engine
from kvfuse.kb.cost import CostModel
from kvfuse.kb.manifest import KBError, Manifest
from kvfuse.kb.prefix import PrefixPlan, plan_prefix
from kvfuse.kb.usage import Usage
from kvfuse.text.tokenizer import Tokenizer


class KBState:
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

    def usage(self) -> dict[str, Any]:
        return self.usage_log.read()

    def swap(self, manifest: Manifest) -> None:
        """The edited manifest, in effect at once (plans are made anew from it)."""
        with self._lock:
            self.manifest = manifest
            self._plans.clear()
