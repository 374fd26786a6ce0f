"""OpenAI's API: GET /v1/models, POST /v1/completions and /v1/chat/completions (streaming or not)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvfuse.kb import answer
from kvfuse.server import logprobs as lp
from kvfuse.server.errors import as_api_error, busy, error_body, route_of
from kvfuse.server.generation import Generating, Outcome
from kvfuse.server.metrics import ARRIVED
from kvfuse.server.planning import Planned, plan_request
from kvfuse.server.routes.jobs import on_worker
from kvfuse.server.schemas import ChatCompletionRequest, CompletionRequest
from kvfuse.server.state import ServerState, of
from kvfuse.server.worker import Job, QueueFull


def router(state: ServerState) -> APIRouter:
    """The routes below, each a named function of this module (the state is the app's: `of`)."""
    del state  # every handler reads the app's own (`of`), the one `create_app` was given
    r = APIRouter()
    r.add_api_route("/v1/models", models, methods=["GET"])
    r.add_api_route("/v1/completions", completions, methods=["POST"])
    r.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    return r


async def models(request: Request) -> dict[str, Any]:
    """GET /v1/models: the one model this server serves."""
    state = of(request)
    state.principal(request)
    return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": 0, "owned_by": "kvfuse"}]}


async def completions(body: CompletionRequest, request: Request) -> Response:
    """POST /v1/completions: planned (`planning.plan_request`), then run by `_generate`."""
    return await _generate(of(request), request, body, chat=False)


async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """POST /v1/chat/completions: planned (`planning.plan_request`), then run by `_generate`."""
    return await _generate(of(request), request, body, chat=True)


async def _generate(state: ServerState, request: Request, body: CompletionRequest | ChatCompletionRequest,
                    chat: bool) -> Response:
    principal = state.principal(request)
    loop = asyncio.get_running_loop()  # tokenising and retrieval scale with the input: off the event loop
    planned = await loop.run_in_executor(state.planner, plan_request, state, body, principal, chat)
    planned.arrived = request.scope.get(ARRIVED, planned.arrived)
    kb, prep = planned.kb, planned.prep
    if kb is not None and prep is not None and answer.needs_warming(kb, prep):
        # a cold prefix is built as a barrier job, before this request starts, never inside a running batch,
        # on the knowledge base as it is then (an edit queued before it may have changed the plan)
        def build() -> tuple[answer.Prepared, tuple[int, float]]:
            fresh = answer.refresh(kb, prep)
            return fresh, answer.warm(kb, fresh, chunks=False)

        fresh, (planned.built, planned.build_s) = await on_worker(state, build)
        planned.prep, planned.request = fresh, fresh.request
    streaming = bool(body.stream)
    try:
        job = state.worker.submit(lambda cancel, emit: Generating(state, planned, cancel, emit, streaming))
    except QueueFull as e:
        raise busy(e.retry_after, f"The server is busy ({state.worker.max_queue} requests queued)") from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    path = route_of(request)
    if streaming:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(state, job, planned, rid, created, chat, include_usage, path),
                                 media_type="text/event-stream")
    outcome = await _wait(job, request)
    logprobs = None
    if outcome.logprobs is not None:
        logprobs = lp.chat(state.tok, outcome.logprobs) if chat else lp.completion(state.tok, outcome.logprobs)
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": outcome.text},
                                  "logprobs": logprobs, "finish_reason": outcome.finish_reason}
    else:
        choice = {"index": 0, "text": outcome.text, "logprobs": logprobs, "finish_reason": outcome.finish_reason}
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": state.model_id, "choices": [choice],
                         "usage": outcome.usage(), "kvfuse": outcome.kvfuse(planned)})


async def _wait(job: Job, request: Request) -> Outcome:
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
            raise as_api_error(value)


async def _sse(state: ServerState, job: Job, p: Planned, rid: str, created: int, chat: bool, include_usage: bool,
               path: str) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    asked = p.params.logprobs is not None
    sent = 0  # characters of the completion streamed so far (its text_offset)

    def chunk(delta: str | None, finish: str | None, extra: dict[str, Any] | None = None,
              role: bool = False, logprobs: dict[str, Any] | None = None) -> str:
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": delta} if delta is not None else {})
            choice: dict[str, Any] = {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
        body = {"id": rid, "object": obj, "created": created, "model": state.model_id, "choices": [choice]}
        body.update(extra or {})
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            yield chunk(None, None, role=True)
        async for kind, value in job.stream():
            if kind == "delta":
                text, entries, before = value
                logprobs = None
                if asked:
                    logprobs = lp.chat(state.tok, entries, before) if chat else lp.completion(
                        state.tok, entries, before, sent)
                sent += len(text)
                yield chunk(text, None, logprobs=logprobs)
            elif kind == "done":
                yield chunk(None, value.finish_reason, {"kvfuse": value.kvfuse(p)})
                if include_usage:
                    body = {"id": rid, "object": obj, "created": created, "model": state.model_id,
                            "choices": [], "usage": value.usage()}
                    yield f"data: {json.dumps(body)}\n\n"
            else:
                state.metrics.stream_errors.labels(path).inc()
                err = as_api_error(value)
                yield f"data: {json.dumps(error_body(err.message, err.type, err.param, err.code))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        job.cancel.set()  # a no-op after "done"; stops the work when the client went away
