"""Knowledge bases over HTTP: POST /v1/kb/{name}/documents, DELETE /v1/kb/{name}/documents/{id} (admin
keys; barrier jobs that rebuild the affected groups) and GET /v1/kb/{name} (groups, documents, usage)."""

from __future__ import annotations

import functools
import logging
from typing import Any

from fastapi import APIRouter, Request

from kvfuse.kb.base import KnowledgeBase
from kvfuse.kb.manifest import Document
from kvfuse.server.errors import ApiError
from kvfuse.server.routes.jobs import on_worker
from kvfuse.server.schemas import DocumentUpsert
from kvfuse.server.state import ServerState, of
from kvfuse.server.worker import QueueFull

log = logging.getLogger(__name__)
RAG_TOKENS = 2000  # a RAG question's prompt: four 500-token chunks (the seed's comparison, `kvfuse kb stats`)


def router(state: ServerState) -> APIRouter:
    """The routes below, each a named function of this module (the state is the app's: `of`)."""
    del state  # every handler reads the app's own (`of`), the one `create_app` was given
    r = APIRouter()
    r.add_api_route("/v1/kb/{name}/documents", put_document, methods=["POST"])
    r.add_api_route("/v1/kb/{name}/documents/{doc_id}", delete_document, methods=["DELETE"])
    r.add_api_route("/v1/kb/{name}", kb_stats, methods=["GET"])
    r.add_api_route("/v1/kb/{name}/documents/{doc_id}", get_document, methods=["GET"])
    r.add_api_route("/v1/me", me, methods=["GET"])
    return r


def _admin(state: ServerState, request: Request, name: str) -> tuple[KnowledgeBase, tuple[str, ...] | None]:
    """The knowledge base and the groups this admin key may edit (None: any)."""
    principal = state.principal(request)
    kb = state.kb_for(name, principal)
    if not principal.admin:
        raise ApiError(403, "This key may not edit knowledge bases (it needs admin = true).", "permission_error",
                       code="not_admin")
    return kb, principal.groups_for(name)


async def put_document(name: str, body: DocumentUpsert, request: Request) -> dict[str, Any]:
    """POST /v1/kb/{name}/documents: add or replace a document (admin keys, their groups only), then
    rebuild what it changed."""
    state = of(request)
    kb, allowed = _admin(state, request, name)
    _editable(kb, body.id, allowed)
    if body.groups and allowed is not None and not set(body.groups) <= set(allowed):
        raise ApiError(403, f"This key may edit only documents of {', '.join(allowed)}.", "permission_error",
                       param="groups", code="group_not_allowed")
    out, groups = await on_worker(state, functools.partial(_put, state, kb, body, allowed))
    return {**out, **await _rebuild(state, kb, groups, request)}


def _put(state: ServerState, kb: KnowledgeBase, body: DocumentUpsert,
         allowed: tuple[str, ...] | None) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The edit itself, on the worker (a barrier job): the document as the body and the old one say."""
    with state.kb_lock:
        m = kb.manifest
        old = _editable(kb, body.id, allowed)
        groups = tuple(body.groups) if body.groups else (
            old.groups if old else (allowed if allowed is not None else m.groups))
        doc = Document(body.id, body.title or (old.title if old else body.id),
                       old.path if old else f"docs/{body.id}.md",
                       body.stability if body.stability is not None else (
                           old.stability if old else max(d.stability for d in m.documents)),
                       tuple(sorted(groups)), body.shared if body.shared is not None else (
                           old.shared if old else False), body.text)
        kb.put_document(doc)
        changed = (*doc.groups, *(old.groups if old else ()))
        return {"kb": kb.name, "id": doc.id, "created": old is None}, changed


async def delete_document(name: str, doc_id: str, request: Request) -> dict[str, Any]:
    """DELETE /v1/kb/{name}/documents/{doc_id} (admin keys), then rebuild what it changed."""
    state = of(request)
    kb, allowed = _admin(state, request, name)
    if _editable(kb, doc_id, allowed) is None:
        raise ApiError(404, f"No document {doc_id!r} in knowledge base {name!r}.", "not_found_error",
                       param="doc_id", code="document_not_found")

    def work() -> tuple[dict[str, Any], tuple[str, ...]]:
        with state.kb_lock:
            groups = kb.manifest.document(doc_id).groups
            kb.delete_document(doc_id)
            return {"kb": kb.name, "id": doc_id, "deleted": True}, groups

    out, groups = await on_worker(state, work)
    return {**out, **await _rebuild(state, kb, groups, request)}


async def kb_stats(name: str, request: Request) -> dict[str, Any]:
    """GET /v1/kb/{name}: the groups this key reads (prefix and cached tokens), their documents, usage."""
    state = of(request)
    principal = state.principal(request)
    kb = state.kb_for(name, principal)
    allowed = principal.groups_for(name)
    groups = [g for g in kb.manifest.groups if allowed is None or g in allowed]
    out: dict[str, Any] = {"name": kb.name, "groups": {}, "documents": []}
    for g in groups:
        plan = kb.plan(g, principal.tenant)
        out["groups"][g] = {"kb_version": plan.version, "prefix_tokens": len(plan.ids),
                            "cached_tokens": kb.cached_tokens(plan), "documents": len(plan.documents)}
    readable = {d.id for g in groups for d in kb.manifest.readable(g)}
    out["documents"] = [{"id": d.id, "title": d.title, "stability": d.stability, "groups": list(d.groups),
                         "shared": d.shared} for d in sorted(kb.manifest.documents, key=lambda d: (d.stability, d.id))
                        if d.id in readable]
    usage = kb.usage()
    out["usage"] = {g: _usage(kb, g, usage[g]) for g in groups if g in usage}
    return out


async def get_document(name: str, doc_id: str, request: Request) -> dict[str, Any]:
    """GET /v1/kb/{name}/documents/{doc_id}: a document this key may read (what the page's viewer shows)."""
    state = of(request)
    principal = state.principal(request)
    kb = state.kb_for(name, principal)
    allowed = principal.groups_for(name)
    doc = next((d for d in kb.manifest.documents if d.id == doc_id), None)
    if doc is None or (allowed is not None and not set(doc.groups) & set(allowed)):
        raise ApiError(404, f"No document {doc_id!r} in knowledge base {name!r} that this key may read.",
                       "not_found_error", param="doc_id", code="document_not_found")
    groups = [g for g in doc.groups if allowed is None or g in allowed]  # never name a group it cannot read
    return {"id": doc.id, "title": doc.title, "text": doc.text, "stability": doc.stability,
            "groups": groups, "shared": doc.shared}


async def me(request: Request) -> dict[str, Any]:
    """GET /v1/me: this key's tenant, whether it may edit, and the knowledge bases and groups it reads."""
    state = of(request)
    principal = state.principal(request)
    kbs = {}
    for name, kb in state.kbs.items():
        allowed = principal.groups_for(name)
        groups = [g for g in kb.manifest.groups if allowed is None or g in allowed]
        if groups:
            kbs[name] = sorted(groups, key=lambda g: allowed.index(g) if allowed else 0)
    return {"tenant": principal.tenant, "admin": principal.admin, "kbs": kbs, "model": state.model_id}


async def _rebuild(state: ServerState, kb: KnowledgeBase, groups: tuple[str, ...], request: Request) -> dict[str, Any]:
    """Rebuild, as barrier jobs queued behind the edit, the prefixes of the edited groups that requests
    have read (every tenant's; none that nobody read). The editing key's own tenant's are awaited and
    reported; the others' run behind them, unawaited (their count is reported, not their tenants)."""
    tenant = state.principal(request).tenant or None
    builds, queued = [], 0
    for g, t in kb.read_prefixes(groups):
        if g not in kb.manifest.groups:
            continue
        build = functools.partial(_ensure_built, state, kb, g, t)
        if t == tenant:
            report = await on_worker(state, build)
            if report is not None:
                builds.append(report)
        else:
            queued += _queue(state, build)
    return {"builds": builds, "rebuilds_queued": queued}


def _ensure_built(state: ServerState, kb: KnowledgeBase, group: str, tenant: str | None) -> dict[str, Any] | None:
    with state.kb_lock:
        report = kb.ensure_built(group, tenant)
    return report.as_dict() if report is not None else None


def _queue(state: ServerState, fn: Any) -> int:
    """Queue a barrier job nobody awaits (1), or skip it when the queue is full (0: the prefix is then
    built before the first request that reads it)."""
    def run() -> Any:
        try:
            return fn()
        except Exception:  # nobody awaits it: say so in the log (the next reader builds it instead)
            log.exception("rebuilding a knowledge-base prefix after an edit failed")
            raise

    try:
        state.worker.submit(lambda cancel, emit: run(), barrier=True)
    except QueueFull:
        return 0
    return 1


def _usage(kb: KnowledgeBase, group: str, used: dict[str, Any]) -> dict[str, Any]:
    """A group's usage with what the same questions would have cost without a cache (every prompt token
    computed) and with RAG (`RAG_TOKENS` computed per question), in the same cost units."""
    return {**used, "no_cache_units": round(used.get("prompt_tokens", 0) * kb.costs.uncached, 3),
            "rag_units": round(used.get("requests", 0) * RAG_TOKENS * kb.costs.uncached, 3)}


def _editable(kb: KnowledgeBase, doc_id: str, allowed: tuple[str, ...] | None) -> Document | None:
    """The existing document, if any; one outside the key's groups is treated as absent (no leak)."""
    old = next((d for d in kb.manifest.documents if d.id == doc_id), None)
    if old is not None and allowed is not None and not set(old.groups) <= set(allowed):
        raise ApiError(404, f"No document {doc_id!r} in knowledge base {kb.name!r} that this key may edit.",
                       "not_found_error", param="id", code="document_not_found")
    return old
