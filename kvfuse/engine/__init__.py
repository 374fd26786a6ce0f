"""The engine (`core.Engine`) and its own parts: the cache manager (`cache`), the first token, drafts
and batched steps (`scheduler`), a running request's state (`decode`), and the load-time fusion check
(`selfcheck`). Token ids only."""

from kvfuse.engine.core import (
    BLOCK_SIZE,
    SCREENED,
    Decoding,
    Engine,
    Generation,
    Mode,
    ModeUnavailableError,
    Request,
    RequestError,
    TokenStream,
)

__all__ = ["BLOCK_SIZE", "SCREENED", "Decoding", "Engine", "Generation", "Mode", "ModeUnavailableError", "Request",
           "RequestError", "TokenStream"]
