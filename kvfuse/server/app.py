"""The FastAPI app: OpenAI's completions and chat completions (streaming or not), models, health,
Prometheus metrics, and knowledge-base document endpoints. Every error is OpenAI's error JSON."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfuse.engine import Engine, ModeUnavailableError, RequestError
from kvfuse.engine import Request as EngineRequest
from kvfuse.kb.base import KnowledgeBase
from kvfuse.kb.manifest import Document, KBError
from kvfuse.sampling import SamplingParams
from kvfuse.server.auth import ANONYMOUS, Keys, Principal
from kvfuse.server.generation import Generating, Outcome, Planned
from kvfuse.server.metrics import Metrics
from kvfuse.server.schemas import ChatCompletionRequest, CompletionRequest, DocumentUpsert, KvfuseOptions
from kvfuse.server.worker import QueueFull, Worker
from kvfuse.store.keys import Salt
from kvfuse.text import ChatTemplate

log = logging.getLogger(__name__)
CHAT_DEFAULT_MAX_TOKENS = 256
COMPLETION_DEFAULT_MAX_TOKENS = 16


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class Limits:
    max_documents: int = 16
    max_document_tokens: int = 4096
    max_queue: int = 16
    max_batch: int = 8  # requests decoding together (capped by what the engine checks batches exactly)


@dataclass
class ServerState:
    engine: Engine
    tok: Any
    model_id: str
    kbs: dict[str, KnowledgeBase] = field(default_factory=dict)
    keys: Keys | None = None
    limits: Limits = field(default_factory=Limits)
    kb_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        batch = min(self.limits.max_batch, self.engine.decode_batch_limit()) if self.limits.max_batch > 1 else 1
        self.worker = Worker(self.limits.max_queue, self.engine.advance, batch)
        self.metrics = Metrics(self.engine.store, lambda: self.worker.depth)
        self.chat = ChatTemplate.for_tokenizer(self.tok)


def _principal(state: ServerState, request: Request) -> Principal:
    if state.keys is None:
        return ANONYMOUS
    p = state.keys.lookup(request.headers.get("authorization"))
    if p is None:
        raise ApiError(401, "Missing or invalid API key: send the header 'Authorization: Bearer <key>'.",
                       "authentication_error", code="invalid_api_key")
    return p


def _kb_for(state: ServerState, name: str, principal: Principal) -> KnowledgeBase:
    kb = state.kbs.get(name)
    allowed = principal.groups_for(name)
    if kb is None or allowed == ():  # a key never learns about knowledge bases it cannot use
        served = ", ".join(n for n in sorted(state.kbs) if principal.groups_for(n) != ()) or "none"
        raise ApiError(404, f"The knowledge base {name!r} does not exist or is not available to this key; "
                            f"available: {served}.", param="kb", code="kb_not_found")
    return kb


def _group(kb: KnowledgeBase, principal: Principal, wanted: str | None) -> str:
    from kvfuse.kb.cli import default_group

    allowed = principal.groups_for(kb.name)
    group = wanted or (allowed[0] if allowed else default_group(kb.manifest))
    if allowed is not None and group not in allowed:
        raise ApiError(403, f"This key may read {kb.name!r} only as {', '.join(allowed)}, not as {group!r}.",
                       "permission_error", param="kvfuse.group", code="group_not_allowed")
    if group not in kb.manifest.groups:
        raise ApiError(400, f"{kb.name!r} has no group {group!r}; its groups are {', '.join(kb.manifest.groups)}.",
                       param="kvfuse.group")
    return group


def plan_request(state: ServerState, body: CompletionRequest | ChatCompletionRequest, principal: Principal,
                 chat: bool) -> Planned:
    eng, tok = state.engine, state.tok
    bad = body.unsupported()
    if bad is not None:
        raise ApiError(400, f"The parameter {bad!r} is not supported by this server; remove it.", param=bad,
                       code="unsupported_parameter")
    if body.model is not None and body.model != state.model_id:
        raise ApiError(404, f"The model {body.model!r} does not exist; this server serves {state.model_id!r}.",
                       param="model", code="model_not_found")
    docs = body.documents or []
    lim = state.limits
    if len(docs) > lim.max_documents:
        raise ApiError(400, f"{len(docs)} documents given, but at most {lim.max_documents} are allowed per request; "
                            "send fewer.", param="documents", code="too_many_documents")
    chunks = []
    for i, d in enumerate(docs):
        doc_ids = tuple(tok.encode(d.text.strip() + "\n\n"))
        if len(doc_ids) > lim.max_document_tokens:
            raise ApiError(400, f"documents[{i}] has {len(doc_ids)} tokens, but at most {lim.max_document_tokens} are "
                                "allowed; split it into smaller documents.", param=f"documents[{i}]",
                           code="document_too_large")
        chunks.append(doc_ids)
    opts = body.kvfuse or KvfuseOptions()
    kb = group = None
    plan_ids: tuple[int, ...] = ()
    bos = [tok.bos_id] if tok.bos_id is not None else []
    prefix: list[int] = list(bos)
    salts: tuple[Any, ...] = ()
    if body.kb is not None:
        kb = _kb_for(state, body.kb, principal)
        group = _group(kb, principal, opts.group)
        try:
            plan = kb.plan(group, principal.tenant)
        except KBError as e:
            raise ApiError(400, str(e), param="kb") from None
        prefix, salts = list(plan.ids), plan.salts
        plan_ids = plan.ids
    elif opts.group is not None:
        raise ApiError(400, "kvfuse.group applies only with a kb.", param="kvfuse.group")
    stop_ids = list(eng.cfg.eos_token_ids)
    if chat:
        assert isinstance(body, ChatCompletionRequest)
        msgs = [(m.role, m.text()) for m in body.messages]
        turns = state.chat.turns(tok, msgs)
        gen = state.chat.generation_prompt(tok)
        if chunks:
            suffix = turns + gen  # the conversation follows the fused documents
        else:
            prefix, suffix = prefix + turns, gen  # the conversation is a cacheable prefix: turn N+1 reuses turn N
        if state.chat.stop_marker:
            stop_ids += [t for t in tok.encode(state.chat.stop_marker)][:1]
        question = msgs[-1][1]
        default_max = CHAT_DEFAULT_MAX_TOKENS
    else:
        assert isinstance(body, CompletionRequest)
        p = body.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise ApiError(400, f"{len(p)} prompts given; this server takes one prompt per request.",
                               param="prompt")
        text_prompt = p if isinstance(p, str) else (str(p[0]) if p and isinstance(p[0], str) else None)
        if text_prompt is not None:
            ids: list[int] = tok.encode(text_prompt)
            question = text_prompt
        else:
            ids = [int(x) for x in p]
            question = ""
        if not ids:
            raise ApiError(400, "The prompt is empty; send some text.", param="prompt")
        if chunks:
            suffix = ids
        else:
            prefix, suffix = prefix + ids[:-1], ids[-1:]  # automatic prefix caching of the prompt
        default_max = COMPLETION_DEFAULT_MAX_TOKENS
    mode = opts.mode or ("blend" if chunks else "prefix")
    if opts.ratio is not None and mode != "blend":
        raise ApiError(400, f"kvfuse.ratio applies only to mode 'blend', not {mode!r}.", param="kvfuse.ratio")
    if principal.tenant:  # everything after the knowledge base (or BOS) is the tenant's own: salt it
        start = len(plan_ids) if kb is not None else len(bos)
        salts = tuple(salts) + (Salt(start, 1 << 62, f"tenant:{principal.tenant}"),)
    req = EngineRequest(suffix=tuple(suffix), prefix=tuple(prefix), chunks=tuple(chunks), salts=salts,
                        chunk_salt=f"tenant:{principal.tenant}" if principal.tenant else "")
    window = eng.cfg.max_position_embeddings
    asked = (body.max_completion_tokens if isinstance(body, ChatCompletionRequest) else None) or body.max_tokens
    max_tokens = asked or max(1, min(default_max, window - len(req)))
    if len(req) + max_tokens > window:
        raise ApiError(400, f"This model's maximum context length is {window} tokens. However, you requested "
                            f"{len(req) + max_tokens} tokens ({len(req)} in the prompt, {max_tokens} for the "
                            "completion). Please shorten the prompt or documents, or lower max_tokens.",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    try:
        eng.validate(req, mode, opts.ratio, max_tokens)
        params = SamplingParams(max_tokens=max_tokens,
                                temperature=1.0 if body.temperature is None else body.temperature,
                                top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                                stop_token_ids=tuple(stop_ids))
    except (RequestError, ModeUnavailableError, ValueError) as e:
        raise ApiError(400, str(e), param="kvfuse") from None
    if opts.quote and (kb is None or not question.strip()):
        raise ApiError(400, "kvfuse.quote needs a kb and a text question.", param="kvfuse.quote")
    stops = body.stops() + (list(state.chat.stop_strings) if chat else [])
    return Planned(req, mode, opts.ratio, params, stops, kb, group, principal.tenant, opts, question,
                   len(plan_ids))


def _usage(o: Outcome) -> dict[str, Any]:
    c = o.result.counts
    n = len(o.result.tokens)
    return {"prompt_tokens": c.prompt, "completion_tokens": n, "total_tokens": c.prompt + n,
            "prompt_tokens_details": {"cached_tokens": max(0, c.cached - o.built_tokens)}}


def _kvfuse(p: Planned, o: Outcome) -> dict[str, Any]:
    r = o.result
    c = r.counts
    cached = max(0, c.cached - o.built_tokens)  # a prefix built for this request was computed, not cached
    return {"ttft_s": round(r.ttft_s + o.build_s, 6), "mode": p.mode, "ratio": r.ratio,
            "recomputed_tokens": c.recomputed, "kb_build_s": round(o.build_s, 6),
            "cached_token_share": round(cached / c.prompt, 4) if c.prompt else 0.0,
            "controller": r.controller.as_dict() if r.controller is not None else None,
            "citations": [x.as_dict() for x in o.citations], "kb": p.kb.name if p.kb else None, "group": p.group}


def create_app(state: ServerState) -> FastAPI:
    from kvfuse import __version__

    app = FastAPI(title="kvfuse", version=__version__,
                  description="OpenAI-compatible completions over CAG knowledge bases and CacheBlend chunk fusion.")
    app.state.kvfuse = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        state.metrics.requests.labels(_route(request), str(e.status)).inc()
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg = f"The request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')}); " \
                  "send a JSON object."
        else:
            where = ".".join(loc) or "body"
            msg = f"Invalid value for '{where}': {first.get('msg', 'invalid')}."
            if len(errs) > 1:
                msg += f" ({len(errs) - 1} more problem{'s' if len(errs) > 2 else ''} in the request.)"
        return JSONResponse(error_body(msg, "invalid_request_error", ".".join(loc) or None, first.get("type")), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> JSONResponse:  # a bug: report it, keep serving
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.worker.alive
        return JSONResponse({"status": "ok" if ok else "worker stopped", "model": state.model_id,
                             "queue_depth": state.worker.depth}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _principal(state, request)
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": 0,
                                            "owned_by": "kvfuse"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _generate(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _generate(request, body, chat=True)

    async def _generate(request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool) -> Response:
        principal = _principal(state, request)
        planned = plan_request(state, body, principal, chat)
        streaming = bool(body.stream)
        try:
            job = state.worker.submit(lambda cancel, emit: Generating(state, planned, cancel, emit, streaming))
        except QueueFull as e:
            raise ApiError(429, f"The server is busy ({state.worker.max_queue} requests queued); retry in "
                                f"{e.retry_after} s.", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        path = _route(request)
        if streaming:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(job, planned, rid, created, chat, include_usage, path),
                                     media_type="text/event-stream")
        outcome = await _wait(job, request)
        state.metrics.requests.labels(path, "200").inc()
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": outcome.text},
                                      "logprobs": None, "finish_reason": outcome.finish_reason}
        else:
            choice = {"index": 0, "text": outcome.text, "logprobs": None, "finish_reason": outcome.finish_reason}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": state.model_id, "choices": [choice],
                             "usage": _usage(outcome), "kvfuse": _kvfuse(planned, outcome)})

    async def _wait(job: Any, request: Request) -> Outcome:
        """The job's outcome; a client that disconnects meanwhile cancels it."""
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except TimeoutError:
                if not job.cancel.is_set() and await request.is_disconnected():
                    job.cancel.set()
                continue
            if kind == "done":
                return value  # type: ignore[no-any-return]
            if kind == "error":
                raise _as_api_error(value)

    async def _sse(job: Any, p: Planned, rid: str, created: int, chat: bool, include_usage: bool,
                   path: str) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, extra: dict[str, Any] | None = None,
                  role: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                    {"content": delta} if delta is not None else {})
                choice: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": state.model_id, "choices": [choice]}
            body.update(extra or {})
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                yield chunk(None, None, role=True)
            async for kind, value in job.stream():
                if kind == "delta":
                    yield chunk(value, None)
                elif kind == "done":
                    yield chunk(None, value.finish_reason, {"kvfuse": _kvfuse(p, value)})
                    if include_usage:
                        body = {"id": rid, "object": obj, "created": created, "model": state.model_id,
                                "choices": [], "usage": _usage(value)}
                        yield f"data: {json.dumps(body)}\n\n"
                    state.metrics.requests.labels(path, "200").inc()
                else:
                    err = _as_api_error(value)
                    yield f"data: {json.dumps(error_body(err.message, err.type, err.param, err.code))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()  # a no-op after "done"; stops the work when the client went away

    # -- knowledge bases -------------------------------------------------------------------------------

    def _kb_admin(request: Request, name: str) -> tuple[KnowledgeBase, tuple[str, ...] | None]:
        """The knowledge base and the groups this admin key may edit (None: any)."""
        principal = _principal(state, request)
        kb = _kb_for(state, name, principal)
        if not principal.admin:
            raise ApiError(403, "This key may not edit knowledge bases (it needs admin = true).", "permission_error",
                           code="not_admin")
        return kb, principal.groups_for(name)

    def _editable(kb: KnowledgeBase, doc_id: str, allowed: tuple[str, ...] | None) -> Document | None:
        """The existing document, if any; one outside the key's groups is treated as absent (no leak)."""
        old = next((d for d in kb.manifest.documents if d.id == doc_id), None)
        if old is not None and allowed is not None and not set(old.groups) <= set(allowed):
            raise ApiError(404, f"No document {doc_id!r} in knowledge base {kb.name!r} that this key may edit.",
                           "not_found_error", param="id", code="document_not_found")
        return old

    async def _on_worker(fn: Any, request: Request) -> Any:
        try:
            job = state.worker.submit(lambda cancel, emit: fn(), barrier=True)
        except QueueFull as e:
            raise ApiError(429, f"The server is busy; retry in {e.retry_after} s.", "rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
        async for kind, value in job.stream():
            if kind == "done":
                return value
            if kind == "error":
                raise _as_api_error(value)

    @app.post("/v1/kb/{name}/documents")
    async def put_document(name: str, body: DocumentUpsert, request: Request) -> dict[str, Any]:
        kb, allowed = _kb_admin(request, name)
        _editable(kb, body.id, allowed)
        if body.groups and allowed is not None and not set(body.groups) <= set(allowed):
            raise ApiError(403, f"This key may edit only documents of {', '.join(allowed)}.", "permission_error",
                           param="groups", code="group_not_allowed")

        def work() -> dict[str, Any]:
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
                builds = [kb.build(g).as_dict() for g in doc.groups if g in kb.manifest.groups]
                return {"kb": kb.name, "id": doc.id, "created": old is None, "builds": builds}

        return await _on_worker(work, request)  # type: ignore[no-any-return]

    @app.delete("/v1/kb/{name}/documents/{doc_id}")
    async def delete_document(name: str, doc_id: str, request: Request) -> dict[str, Any]:
        kb, allowed = _kb_admin(request, name)
        if _editable(kb, doc_id, allowed) is None:
            raise ApiError(404, f"No document {doc_id!r} in knowledge base {name!r}.", "not_found_error",
                           param="doc_id", code="document_not_found")

        def work() -> dict[str, Any]:
            with state.kb_lock:
                groups = kb.manifest.document(doc_id).groups
                kb.delete_document(doc_id)
                builds = [kb.build(g).as_dict() for g in groups if g in kb.manifest.groups]
                return {"kb": kb.name, "id": doc_id, "deleted": True, "builds": builds}

        return await _on_worker(work, request)  # type: ignore[no-any-return]

    @app.get("/v1/kb/{name}")
    async def kb_stats(name: str, request: Request) -> dict[str, Any]:
        principal = _principal(state, request)
        kb = _kb_for(state, name, principal)
        allowed = principal.groups_for(name)
        groups = [g for g in kb.manifest.groups if allowed is None or g in allowed]
        out: dict[str, Any] = {"name": kb.name, "groups": {}, "documents": []}
        for g in groups:
            plan = kb.plan(g, principal.tenant)
            out["groups"][g] = {"kb_version": plan.version, "prefix_tokens": len(plan.ids),
                                "cached_tokens": kb.cached_tokens(plan), "documents": len(plan.documents)}
        readable = {d.id for g in groups for d in kb.manifest.readable(g)}
        out["documents"] = [{"id": d.id, "title": d.title, "stability": d.stability, "groups": list(d.groups),
                             "shared": d.shared} for d in sorted(kb.manifest.documents, key=lambda d: (d.stability,
                                                                                                     d.id))
                            if d.id in readable]
        usage = kb.usage()
        out["usage"] = {g: usage[g] for g in groups if g in usage}
        return out

    return app


def _route(request: Request) -> str:
    """The matched route's template (never the raw path: metric labels must stay few)."""
    route = request.scope.get("route")
    return str(getattr(route, "path", "unmatched"))


def _as_api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, KBError | RequestError | ModeUnavailableError):
        return ApiError(400, str(e))
    if isinstance(e, asyncio.CancelledError):
        return ApiError(499, "The request was cancelled.", code="cancelled")
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


__all__: Sequence[str] = ["ApiError", "Limits", "ServerState", "create_app"]
