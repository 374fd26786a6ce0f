"""What a router in front of several replicas (SMG) reads of a worker: its load and its model.

SMG registers a worker through `/health` and `/v1/models`, then polls `/v1/loads`; `/get_model_info` and
`/get_load` are the names SGLang's router family uses. kvfuse answers these honestly and no more: it
does not answer `/version` or `/server_info`, whose presence would make SMG take it for vLLM or SGLang.
None of them says anything secret (the model's name and the queue), so they need no key: a router
checks them without one.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kvfuse.server.state import ServerState


def load(state: ServerState) -> dict[str, Any]:
    """The queue as SMG's load report reads it; tokens are counted in KV bytes of the memory tier."""
    running = state.worker.running
    waiting = max(0, state.worker.depth - running)
    memory = state.engine.store.tiers[0]
    used, cap = memory.used_bytes, memory.capacity_bytes
    per_token = max(1, state.engine.cache.kv_bytes_per_token)
    return {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_reqs": running + waiting, "max_running_requests": state.limits.max_batch,
            "num_used_tokens": used // per_token, "max_total_num_tokens": cap // per_token,
            "token_usage": round(used / cap, 4) if cap else 0.0}


def router(state: ServerState) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        return {"dp_rank_count": 1, "loads": [load(state)]}

    @r.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return [load(state)]

    @r.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        cfg = state.engine.cfg
        return {"model_path": state.model_id, "tokenizer_path": state.model_id, "is_generation": True,
                "weight_version": state.engine.fingerprint, "precision": state.engine.precision,
                "max_context_length": cfg.max_position_embeddings, "served_by": "kvfuse"}

    return r
