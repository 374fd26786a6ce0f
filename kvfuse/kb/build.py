"""Building a group's cached prefix: compute the blocks not stored yet (an edit recomputes from the
first changed block to the end), store them pinned, and record what was built beside the store so the
next build unpins what an edit made obsolete; then the partial last block's tail entry, unpinned, so a
question computes only itself. When everything is stored already (a restart, say), the build only
reads it, so the first question finds it in memory.

The plan's block hashes are computed once (`CacheManager.block_hashes`) and sliced for every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvfuse.jsonfile import read_json, write_json
from kvfuse.kb.prefix import PrefixPlan
from kvfuse.kb.usage import build_record_path, kb_state_dir, locked
from kvfuse.kv import one_thread

if TYPE_CHECKING:
    from kvfuse.kb.state import KBState

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


def stored_tokens(kb: KBState, plan: PrefixPlan) -> int:
    """How many of the prefix's tokens are stored: a run of full blocks from the start, and the partial
    last block's tail entry (`CacheManager.tail_key`) once every full block is."""
    cache = kb.engine.cache
    hashes = cache.block_hashes(plan.ids, plan.salts)
    n = cache.stored_blocks(hashes)
    tail = cache.tail_key(plan.ids, plan.salts, hashes)
    full = n == len(hashes) and tail is not None and tail in cache.store
    return n * cache.block_size + (len(plan.ids) - n * cache.block_size if full else 0)


def needs_build(kb: KBState, plan: PrefixPlan) -> bool:
    """Some full block of the prefix is not stored. (A missing tail entry alone, unpinned and perhaps
    evicted, is not worth a build on a question's path: the next `prefix` request stores it again.)"""
    bs = kb.engine.cache.block_size
    return stored_tokens(kb, plan) < len(plan.ids) // bs * bs


def build(kb: KBState, plan: PrefixPlan, progress: bool = False) -> BuildReport:
    """Compute and store (pinned) what is not stored of the plan's prefix; load it when all is."""
    from tqdm import tqdm

    kb.check_length(plan)
    cache = kb.engine.cache
    bs = cache.block_size
    hashes = cache.block_hashes(plan.ids, plan.salts)
    n_full = len(hashes) * bs
    t0 = time.perf_counter()
    # Replicas sharing a Redis tier build a prefix once: the others wait for the lock, then find every
    # block stored and only read them (a holder that dies frees the lock after its TTL).
    with cache.store.exclusive(f"prefix:{hashes[-1]}" if hashes else "prefix:none"):
        reused = stored_tokens(kb, plan)
        loaded = reused == len(plan.ids)
        computed = 0
        if loaded:  # stored already: read every block once, so the first question finds them in memory
            tail = cache.tail_key(plan.ids, plan.salts, hashes)
            with one_thread():
                for h in hashes:
                    cache.store.pin(h)
                    cache.store.get(h)
                if tail is not None:
                    cache.store.get(tail)
        else:
            start = min(reused, n_full)
            steps = list(range(start + BUILD_STEP - start % BUILD_STEP, n_full, BUILD_STEP)) + [n_full]
            with tqdm(total=len(plan.ids) - reused, desc=f"building {kb.name}/{plan.group}", unit="tok",
                      disable=not progress) as bar:
                for end in steps:
                    c = cache.precompute_prefix(plan.ids[:end], plan.salts, pin=True, hashes=hashes[: end // bs])
                    computed += c
                    bar.update(c)
                # the partial last block, after the full ones: stored unpinned (computed again if evicted)
                c = cache.precompute_prefix(plan.ids, plan.salts, pin=True, hashes=hashes)
                computed += c
                bar.update(c)
            cache.store.flush()  # in every tier (Redis too) before the lock is released
            reused = len(plan.ids) - computed  # a tail found stored after missing blocks counts as reused
    report = BuildReport(kb.name, plan.group, plan.tenant, plan.version, len(plan.ids), reused, computed,
                         round(time.perf_counter() - t0, 4), n_full * cache.kv_bytes_per_token, loaded)
    _record(kb, plan, hashes, report)
    return report


def _record(kb: KBState, plan: PrefixPlan, hashes: Sequence[str], report: BuildReport) -> None:
    """Remember this version's blocks; unpin the previous version's blocks that it no longer uses."""
    record = {"kb_version": plan.version, "blocks": list(hashes), "last_build": report.as_dict(),
              "group": plan.group, "tenant": plan.tenant, "built_at": time.time()}
    _update(kb, plan.group, plan.tenant, lambda old: record)


def _update(kb: KBState, group: str, tenant: str | None,
            change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
    """Replace a build record by change(old record) (None: remove it), unpinning the blocks the old one
    pinned that the new one does not list. In the state dir when the knowledge base has one, else in memory."""
    key = (group, tenant or None)

    def apply(old: dict[str, Any]) -> dict[str, Any] | None:
        new = change(old)
        keep = set(new["blocks"]) if new else set()
        for h in old.get("blocks", []):
            if h not in keep:
                kb.engine.store.unpin(h)
        return new

    if kb.state_dir is None:
        new = apply(kb.records.pop(key, {}))
        if new is not None:
            kb.records[key] = new
        return
    path = build_record_path(kb.state_dir, kb.name, group, tenant)
    with locked(path):
        new = apply(read_json(path))
        if new is None:
            path.unlink(missing_ok=True)
        else:
            write_json(path, new)


def built_prefixes(kb: KBState) -> list[tuple[str, str | None]]:
    """The (group, tenant) prefixes that have a build record: those whose blocks are pinned."""
    if kb.state_dir is None:
        return sorted(kb.records, key=lambda k: (k[0], k[1] or ""))
    found = []
    for path in sorted(kb_state_dir(kb.state_dir, kb.name).glob("*.json")):
        rec = read_json(path)
        if "blocks" in rec and isinstance(rec.get("group"), str):
            found.append((rec["group"], rec.get("tenant") or None))
    return found


def unpin_obsolete(kb: KBState) -> None:
    """After an edit: for every built prefix, of every tenant, unpin the blocks the knowledge base as it
    is now no longer uses (a group that is gone loses its record); what is still used stays pinned."""
    for group, tenant in built_prefixes(kb):
        if group not in kb.manifest.groups:
            _update(kb, group, tenant, lambda old: None)
            continue
        plan = kb.plan(group, tenant)
        now: set[str] = set(kb.engine.cache.block_hashes(plan.ids, plan.salts))

        def keep_used(old: dict[str, Any], now: set[str] = now) -> dict[str, Any]:
            return {**old, "blocks": [h for h in old.get("blocks", []) if h in now]}

        _update(kb, group, tenant, keep_used)
