"""A knowledge base served by CAG: one cached prefix per access group (and tenant), answered from.

`KnowledgeBase` is the knowledge base's data (`state.KBState`: what the pipeline reads) with shorthands
for the pipeline and the edits. Building is `kb/build.py`; answering is `kb/answer.py`, which the CLI,
the demo and the server all call; both take the data, never this class, so no module of the pipeline
imports this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvfuse.engine.core import Engine
from kvfuse.engine.sampling import TokenConstraint
from kvfuse.kb import answer as pipeline
from kvfuse.kb.build import BuildReport, build, needs_build, stored_tokens, unpin_obsolete
from kvfuse.kb.cost import CostModel
from kvfuse.kb.manifest import Document, Manifest, delete_document, load_manifest, put_document, with_document
from kvfuse.kb.prefix import PrefixPlan, plan_prefix
from kvfuse.kb.state import KBState
from kvfuse.rag.index import IndexChunk
from kvfuse.request import Ratio
from kvfuse.text.tokenizer import Tokenizer


class KnowledgeBase(KBState):
    @classmethod
    def open(cls, path: str | Path, engine: Engine, tok: Tokenizer, state_dir: Path | None = None,
             costs: CostModel | None = None) -> KnowledgeBase:
        return cls(engine, tok, load_manifest(path), state_dir, costs)

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
            ratio: Ratio = None, max_tokens: int = pipeline.ANSWER_TOKENS, quote: bool = True,
            constraint: TokenConstraint | None = None) -> pipeline.Answer:
        return pipeline.ask(self, question, group, tenant, chunks, ratio, max_tokens, quote, constraint)

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
        self.swap(manifest)
        unpin_obsolete(self)
