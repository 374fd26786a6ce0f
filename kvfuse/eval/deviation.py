"""`kvfuse eval deviation`: the paper's insight figures, measured on the real model.

1. Attention deviation against the recompute ratio. For each layer, the forward attention of the
   suffix (question) rows over all keys is computed on top of full prefill's cache and on top of
   blend's; the deviation is the L2 norm of the difference of the two attention rows, averaged over
   heads, rows and layers. HKVD selection is compared with random selection under the same schedule
   (the ablation), and full KV reuse is the ratio-0 point.
2. Cross-layer stability of HKVD tokens. With the true KV deviation (full prefill's KV against the
   reused, re-rotated chunk KV), take each layer's top-r chunk tokens and measure the share that are
   also in the next layer's top-r. Random sets would overlap by r.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvfuse import fuse
from kvfuse.engine.core import Engine
from kvfuse.eval.data import Case
from kvfuse.kv import KVCache
from kvfuse.model import Decoder
from kvfuse.text import Prompt, Tokenizer


def suffix_attention(model: Decoder, cache: KVCache, suffix: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the attention (heads, S, T) of the suffix rows over a cache whose last S entries are the suffix.

    The suffix is recomputed on the cache's keys before it, so the rows are those the cache leads to."""
    s = len(cache) - suffix.shape[0]
    pos_all = torch.arange(len(cache))
    pos = pos_all[s:]
    h = model.embed(suffix)
    out = []
    for i in range(model.cfg.num_layers):
        q, k, v = model.project(i, h, pos)
        keys, values = torch.cat((cache.k[i][:, :s], k), 1), torch.cat((cache.v[i][:, :s], v), 1)
        out.append(model.attention_weights(i, q, pos, keys, pos_all))
        h = model.finish(i, h, model.attend(i, q, pos, keys, values, pos_all))
    return out


def attention_deviation(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[float]:
    """Per layer: mean over heads and rows of the L2 norm of the difference of attention rows."""
    return [float((x - y).norm(dim=-1).mean()) for x, y in zip(a, b, strict=True)]


def top_overlap(dev: Sequence[torch.Tensor], ratio: float) -> list[float]:
    """Share of layer l's top-ratio tokens (by deviation) that are also in layer l+1's."""
    n = dev[0].shape[0]
    k = max(1, round(ratio * n))
    tops = [set(torch.topk(d, k).indices.tolist()) for d in dev]
    return [len(tops[i] & tops[i + 1]) / k for i in range(len(tops) - 1)]


def run_deviation(engine: Engine, tok: Tokenizer, cases: Sequence[Case], ratios: Sequence[float], top_k: int,
                  chunk_tokens: int, out: Path, progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    from kvfuse.eval.harness import retrieve

    model, cfg = engine.model, engine.cfg
    dev_hkvd: dict[float, list[list[float]]] = {r: [] for r in ratios}
    dev_rand: dict[float, list[list[float]]] = {r: [] for r in ratios}
    dev_reuse: list[list[float]] = []
    overlaps: dict[float, list[list[float]]] = {r: [] for r in ratios}
    gen = torch.Generator().manual_seed(0)

    def random_choice(k: torch.Tensor, v: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor:
        return torch.rand(k.shape[1], generator=gen)

    with torch.inference_mode():
        for case in tqdm(cases, desc="deviation", unit="case", disable=not progress):
            req = Prompt(chunks=retrieve(case, tok, top_k, chunk_tokens), question=case.question).request(tok)
            full = fuse.prefill(model, torch.tensor(req.ids)).cache
            suffix = torch.tensor(req.suffix)
            ref = suffix_attention(model, full, suffix)
            prefix = fuse.prefill(model, torch.tensor(req.prefix)).cache
            caches = [fuse.precompute_chunk(model, engine.preamble, c) for c in req.chunks]
            ids = [torch.tensor(c) for c in req.chunks]
            layout = fuse.FuseLayout.of(prefix, caches, suffix, ids)
            reused = fuse.reuse(model, layout).cache
            dev_reuse.append(attention_deviation(suffix_attention(model, reused, suffix), ref))
            span = slice(len(req.prefix), len(req.prefix) + sum(len(c) for c in req.chunks))
            kv_dev = [fuse.kv_deviation(full.k[i][:, span], full.v[i][:, span], reused.k[i][:, span],
                                        reused.v[i][:, span]) for i in range(cfg.num_layers)]
            for r in ratios:
                hk = fuse.blend(model, layout, r).cache
                rd = fuse.blend(model, layout, r, deviation=random_choice).cache
                dev_hkvd[r].append(attention_deviation(suffix_attention(model, hk, suffix), ref))
                dev_rand[r].append(attention_deviation(suffix_attention(model, rd, suffix), ref))
                overlaps[r].append(top_overlap(kv_dev, r))

    def mean_layers(rows: list[list[float]]) -> list[float]:
        return [statistics.mean(col) for col in zip(*rows, strict=True)]

    result: dict[str, Any] = {
        "cases": len(cases), "top_k": top_k, "chunk_tokens": chunk_tokens, "ratios": list(ratios),
        "attention_deviation": {
            "reuse": statistics.mean(mean_layers(dev_reuse)),
            "hkvd": {str(r): statistics.mean(mean_layers(dev_hkvd[r])) for r in ratios},
            "random": {str(r): statistics.mean(mean_layers(dev_rand[r])) for r in ratios},
            "per_layer": {"reuse": mean_layers(dev_reuse),
                          **{f"hkvd@{r}": mean_layers(dev_hkvd[r]) for r in ratios},
                          **{f"random@{r}": mean_layers(dev_rand[r]) for r in ratios}},
        },
        "hkvd_overlap": {str(r): {"per_layer": mean_layers(overlaps[r]),
                                  "mean": statistics.mean(mean_layers(overlaps[r])), "random_baseline": r}
                         for r in ratios},
    }
    out.mkdir(parents=True, exist_ok=True)
    result["files"] = _plots(result, out) + ["deviation.json"]
    (out / "deviation.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    return result


def _plots(result: dict[str, Any], out: Path) -> list[str]:
    from kvfuse.eval.report import pyplot

    plt = pyplot()
    ratios = result["ratios"]
    dev = result["attention_deviation"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([0.0] + ratios, [dev["reuse"]] + [dev["hkvd"][str(r)] for r in ratios], "o-", label="HKVD (blend)")
    ax.plot([0.0] + ratios, [dev["reuse"]] + [dev["random"][str(r)] for r in ratios], "s--", label="random")
    ax.set_xlabel("recompute ratio (0 = full KV reuse)")
    ax.set_ylabel("attention deviation from full")
    ax.set_title(f"suffix attention deviation, {result['cases']} cases")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "attention_deviation.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in ratios:
        ov = result["hkvd_overlap"][str(r)]["per_layer"]
        line = ax.plot(range(1, len(ov) + 1), ov, "o-", ms=3, label=f"r={r}")[0]
        ax.axhline(r, color=line.get_color(), ls=":", lw=1)
    ax.set_xlabel("layer l (overlap of its top-r with layer l+1's)")
    ax.set_ylabel("overlap (dotted: random)")
    ax.set_title("cross-layer stability of HKVD tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "hkvd_overlap.png", dpi=110)
    plt.close(fig)
    return ["attention_deviation.png", "hkvd_overlap.png"]
