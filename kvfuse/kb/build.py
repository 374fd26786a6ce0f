"""Building a group's cached prefix: compute the blocks not stored yet (an edit recomputes from the
first changed block to the end), store them pinned, and record what was built beside the store so the
next build unpins what an edit made obsolete. When every block is stored already (a restart, say), the
build only reads them, so the first question finds them in memory.

The plan's block hashes are computed once (`CacheManager.block_hashes`) and sliced for every step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvfuse.kb.prefix import PrefixPlan
from kvfuse.kb.usage import build_record_path, locked, read_json, write_json
from kvfuse.kv import one_thread

if TYPE_CHECKING:
    from kvfuse.kb.base import KnowledgeBase

BUILD_STEP = 1024  # tokens per build step (one progress-bar tick)


@dataclass(slots=True)
class BuildReport:
    kb: str
    group: str
    tenant: str | None
    kb_version: str
    tokens_total: int
    tokens_reused: int
    tokens_recomputed: int
    build_s: float
    bytes: int
    loaded: bool  # everything was already stored: the blocks were only loaded

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def stored_tokens(kb: KnowledgeBase, plan: PrefixPlan) -> int:
    """How many of the prefix's tokens are stored, as a run of full blocks from the start."""
    cache = kb.engine.cache
    return cache.stored_blocks(cache.block_hashes(plan.ids, plan.salts)) * cache.block_size


def needs_build(kb: KnowledgeBase, plan: PrefixPlan) -> bool:
    """Some full block of the prefix is not stored."""
    bs = kb.engine.cache.block_size
    return stored_tokens(kb, plan) < len(plan.ids) // bs * bs


def build(kb: KnowledgeBase, plan: PrefixPlan, progress: bool = False) -> BuildReport:
    """Compute and store (pinned) what is not stored of the plan's prefix; load it when all is."""
    from tqdm import tqdm

    kb.check_length(plan)
    cache = kb.engine.cache
    bs = cache.block_size
    hashes = cache.block_hashes(plan.ids, plan.salts)
    n_full = len(hashes) * bs
    t0 = time.perf_counter()
    reused = cache.stored_blocks(hashes) * bs
    loaded = reused == n_full
    computed = 0
    if loaded:  # stored already: read every block once, so the first question finds them in memory
        with one_thread():
            for h in hashes:
                cache.store.pin(h)
                cache.store.get(h)
    else:
        steps = list(range(reused + BUILD_STEP - reused % BUILD_STEP, n_full, BUILD_STEP)) + [n_full]
        with tqdm(total=n_full - reused, desc=f"building {kb.name}/{plan.group}", unit="tok",
                  disable=not progress) as bar:
            for end in steps:
                c = kb.engine.cache.precompute_prefix(plan.ids[:end], plan.salts, pin=True, hashes=hashes[: end // bs])
                computed += c
                bar.update(c)
        cache.store.flush()
    cfg = kb.engine.cfg
    per_token = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * cache.kv_dtype.itemsize
    report = BuildReport(kb.name, plan.group, plan.tenant, plan.version, len(plan.ids), reused, computed,
                         round(time.perf_counter() - t0, 4), n_full * per_token, loaded)
    _record(kb, plan, hashes, report)
    return report


def _record(kb: KnowledgeBase, plan: PrefixPlan, hashes: Sequence[str], report: BuildReport) -> None:
    """Remember this version's blocks; unpin the previous version's blocks that it no longer uses."""
    if kb.state_dir is None:
        return
    path = build_record_path(kb.state_dir, kb.name, plan.group, plan.tenant)
    with locked(path):
        old = read_json(path)
        keep = set(hashes)
        for h in old.get("blocks", []):
            if h not in keep:
                kb.engine.store.unpin(h)
        write_json(path, {"kb_version": plan.version, "blocks": list(hashes), "last_build": report.as_dict(),
                          "built_at": time.time()})
