"""Building a request's KV cache: the layer loop (`core`) and the registered fusers.

Built-in fusers register on import, in this order, the same way an extension would: full and prefix
(exact), reuse, blend (CacheBlend, the paper baseline), legolink (EPIC's baseline) and queryaware
(ProphetKV-style selection by the question's attention, over chunks computed behind a copy of
themselves: the default mode).
"""

# The built-ins register in this order, which is the order of the modes wherever they are listed.
# isort: off
from kvfuse.fuse.exact import Full, Prefix
from kvfuse.fuse.kvreuse import Reuse, reuse
from kvfuse.fuse.cacheblend import DEFAULT_FILTER_LAYERS, DEFAULT_RATIO, Blend, blend, keep_schedule
from kvfuse.fuse.epic import DEFAULT_HEAD_TOKENS, Legolink, legolink
from kvfuse.fuse.queryaware import QueryAware, query_aware
# isort: on
from kvfuse.fuse.core import (
    IN_PLACE,
    Deviation,
    FuseContext,
    Fused,
    FuseLayout,
    Pause,
    Rerotate,
    Resume,
    fuse_chunks,
    kv_deviation,
    no_pause,
    precompute_chunk,
    prefill,
)
from kvfuse.fuse.registry import (
    BEHIND,
    DEFAULT_MODE,
    FUSERS,
    HEAD_PREAMBLE_MAX,
    NEIGHBOUR_TOKENS,
    Fuser,
    chunk_preambles,
    default_mode,
    for_model,
    fuser_key,
    get_fuser,
    modes,
    parse_fuser,
    parse_spec,
    register_fuser,
    residual_layer,
    spec_of,
)

__all__ = [
    "BEHIND",
    "DEFAULT_FILTER_LAYERS",
    "DEFAULT_HEAD_TOKENS",
    "DEFAULT_MODE",
    "DEFAULT_RATIO",
    "FUSERS",
    "HEAD_PREAMBLE_MAX",
    "IN_PLACE",
    "NEIGHBOUR_TOKENS",
    "Blend",
    "Deviation",
    "Full",
    "FuseContext",
    "FuseLayout",
    "Fused",
    "Fuser",
    "Legolink",
    "Pause",
    "Prefix",
    "QueryAware",
    "Rerotate",
    "Resume",
    "Reuse",
    "blend",
    "chunk_preambles",
    "default_mode",
    "fuse_chunks",
    "for_model",
    "fuser_key",
    "get_fuser",
    "keep_schedule",
    "kv_deviation",
    "legolink",
    "modes",
    "no_pause",
    "parse_fuser",
    "parse_spec",
    "precompute_chunk",
    "prefill",
    "query_aware",
    "register_fuser",
    "residual_layer",
    "reuse",
    "spec_of",
]
