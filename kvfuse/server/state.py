"""What the routes share: the engine and its tokenizer, the knowledge bases, keys, limits, the worker,
the metrics and the chat template."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from kvfuse.engine.core import Engine
from kvfuse.kb.base import KnowledgeBase
from kvfuse.server.auth import ANONYMOUS, Keys, Principal
from kvfuse.server.errors import ApiError
from kvfuse.server.metrics import Metrics
from kvfuse.server.worker import DEFAULT_MAX_ITL_FACTOR, Worker
from kvfuse.text.chat import ChatTemplate

PLANNER_NICE = 15  # the planner thread's CPU priority: below the worker and the event loop
BODY_BYTES_PER_TOKEN = 16  # JSON bytes per token allowed: text runs 3-5 bytes a token, \u-escaped text up to 12


@dataclass
class Limits:
    max_documents: int = 16
    max_document_tokens: int = 4096
    max_queue: int = 16
    max_batch: int = 8  # requests decoding together (capped by what the engine checks batches exactly)
    max_itl_factor: float = DEFAULT_MAX_ITL_FACTOR  # running streams' pace while a newcomer prefills (worker.py)
    max_body_bytes: int | None = None  # None: sized from the window and the document limits (`body_limit`)
    metrics_public: bool = False  # /metrics without a key, when keys are set

    def body_limit(self, window: int) -> int:
        """The largest request body taken: a prompt filling the window plus the most documents allowed,
        at BODY_BYTES_PER_TOKEN each, plus room for the JSON around them."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return BODY_BYTES_PER_TOKEN * (window + self.max_documents * self.max_document_tokens) + (64 << 10)


def _low_priority() -> None:
    """Lower this thread's CPU priority (Linux: a thread is a schedulable task with its own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PLANNER_NICE)
    except (OSError, AttributeError):  # not permitted, or not Linux: plan at the usual priority
        pass


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
        self.worker = Worker(self.limits.max_queue, self.engine.advance, batch, self.limits.max_itl_factor)
        self.metrics = Metrics(self.engine.store, lambda: self.worker.depth)
        self.chat = ChatTemplate.for_model(self.engine.cfg.model_type, self.tok)
        # planning (tokenising, retrieval) runs here, off the event loop, one request at a time, at a low CPU
        # priority: a huge body's tokenising must not take cores from the running streams' decoding
        self.planner = ThreadPoolExecutor(1, thread_name_prefix="kvfuse-plan", initializer=_low_priority)

    def principal(self, request: Request) -> Principal:
        if self.keys is None:
            return ANONYMOUS
        p = self.keys.lookup(request.headers.get("authorization"))
        if p is None:
            raise ApiError(401, "Missing or invalid API key: send the header 'Authorization: Bearer <key>'.",
                           "authentication_error", code="invalid_api_key")
        return p

    def metrics_reader(self, request: Request) -> None:
        """/metrics: open without keys or with --metrics-public; else any valid key."""
        if not self.limits.metrics_public:
            self.principal(request)

    def kb_for(self, name: str, principal: Principal) -> KnowledgeBase:
        kb = self.kbs.get(name)
        allowed = principal.groups_for(name)
        if kb is None or allowed == ():  # a key never learns about knowledge bases it cannot use
            served = ", ".join(n for n in sorted(self.kbs) if principal.groups_for(n) != ()) or "none"
            raise ApiError(404, f"The knowledge base {name!r} does not exist or is not available to this key; "
                                f"available: {served}.", param="kb", code="kb_not_found")
        return kb


def of(request: Request) -> ServerState:
    """The server state of the app that received the request (`create_app` keeps it on the app)."""
    state: ServerState = request.app.state.kvfuse
    return state
