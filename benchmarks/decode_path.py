"""Two costs of answering on a cached knowledge base, each against what it replaced, side by side (stop 50).

    .venv/bin/python benchmarks/decode_path.py [--rounds 5] [--precision bf16]

1. **Decoding attention** over a 10k-token cache (one kv head of 256, four query heads: Gemma 3 270M's
   shape): `Decoder.attend_all` (scores as keys times queries, the weighted values over two halves of
   the keys batched) against the formulation before it (queries times keys, one product for the values),
   both on the same tensors, interleaved; and whole decoding steps (`decode.step_rows`, 1 and 4 rows)
   with each of the two, on the real model with a random 10k-token cache.
2. **A question's TTFT on the cached Albarán prefix** (`prefix` mode, about 10k tokens): with the buffer
   pool (`fuse.buffers`: kept buffers, the prefix already in place) and the prefix's tail entry
   (`CacheManager.tail_key`: only the question computed); with the pool but the tail computed again; and
   as at stop 48 (`keep = 0`: new buffers every time, every block copied, the tail computed), interleaved.
Medians of `--rounds` rounds, ratios per round; the CPU is printed with them.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, median_ratio, timed  # noqa: E402

from kvfuse import model as model_mod  # noqa: E402
from kvfuse.checkpoints import resolve_model_path  # noqa: E402
from kvfuse.engine import Engine  # noqa: E402
from kvfuse.engine.decode import Slot, step_rows  # noqa: E402
from kvfuse.engine.sampling import SamplingParams  # noqa: E402
from kvfuse.fuse.buffers import POOL  # noqa: E402
from kvfuse.kv import KVCache  # noqa: E402

CONTEXT = 10_000


def before(self: model_mod.Decoder, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`Decoder.attend_all` as it was before stop 50 (no softcap): queries times keys."""
    cfg = self.cfg
    kv_heads, tq = k.shape[0], q.shape[1]
    qg = q.reshape(kv_heads, -1, cfg.head_dim)
    probs = torch.softmax((qg @ k.transpose(1, 2)).float() * cfg.query_scale, dim=-1).to(v.dtype)
    out = (probs @ v).reshape(cfg.num_heads, tq, cfg.head_dim)
    return out.transpose(0, 1).reshape(q.shape[1], cfg.num_heads * cfg.head_dim)



def attention(engine: Engine, rounds: int) -> None:
    m, cfg = engine.model, engine.model.cfg
    shape = (cfg.num_layers, cfg.num_kv_heads, CONTEXT, cfg.head_dim)
    g = torch.Generator().manual_seed(0)
    cache = KVCache(torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.arange(CONTEXT))
    slot = Slot(m, cache, 64)
    q = torch.randn(cfg.num_heads, 1, cfg.head_dim, generator=g)
    now = model_mod.Decoder.attend_all
    layers = range(cfg.num_layers)  # one call per layer's cache: none stays in the CPU's caches

    def one_layer(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
        return lambda: [fn(m, i, q, slot.k[i], slot.v[i]) for i in layers]

    def step(rows: int) -> Callable[[], None]:
        def run() -> None:
            step_rows(m, [slot], [list(range(5, 5 + rows))])
            slot.rewind(rows)
        return run

    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, impl in (("before", before), ("now", now)):
                times.setdefault(f"attention {name}", []).append(timed(one_layer(impl), 5) / cfg.num_layers)
                model_mod.Decoder.attend_all = impl  # type: ignore[method-assign]
                try:
                    for rows in (1, 4):
                        times.setdefault(f"step {rows} {name}", []).append(timed(step(rows), 5))
                finally:
                    model_mod.Decoder.attend_all = now  # type: ignore[method-assign]
    print(f"\n1. Decoding attention over {CONTEXT} keys ({engine.precision}), median of {rounds} rounds\n")
    print("| what | before (ms) | now (ms) | now / before |")
    print("|---|---|---|---|")
    for what, label in (("attention", "one row's attention, per layer"), ("step 1", "a step of 1 row, 18 layers"),
                        ("step 4", "a step of 4 rows (a draft of 3)")):
        b, n = times[f"{what} before"], times[f"{what} now"]
        print(f"| {label} | {1000 * statistics.median(b):.2f} | {1000 * statistics.median(n):.2f} | "
              f"**{median_ratio(n, b):.2f}** |")


def ttft(engine: Engine, rounds: int, store: str) -> None:
    from kvfuse.kb import answer
    from kvfuse.kb.base import KnowledgeBase
    from kvfuse.kb.manifest import resolve_kb_dir
    from kvfuse.text import Tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="kvfuse-decode-path-"))
    kb_dir = tmp / "albaran"
    shutil.copytree(resolve_kb_dir("albaran"), kb_dir)
    kb = KnowledgeBase.open(kb_dir, engine, Tokenizer(resolve_model_path(None)), state_dir=Path(store))
    kb.build("support")
    req = answer.prepare(kb, "How many days does a Team plan customer have to ask for a refund on an annual "
                         "renewal?", "support").request
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    keep, read_tail = POOL.keep, engine.cache.read_tail
    variants = {"pool and tail entry (now)": (keep, True), "pool, the tail computed (no tail entry)": (keep, False),
                "new buffers, the tail computed (stop 48)": (0, False)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    engine.generate(req, "prefix", params=params)  # warm: the screen is built, the blocks are in memory
    for _ in range(rounds):
        for name, (k, tail) in variants.items():
            POOL.keep = k
            engine.cache.read_tail = read_tail if tail else (lambda key, n: None)  # type: ignore[method-assign]
            times[name].append(statistics.median(engine.generate(req, "prefix", params=params).ttft_s
                                                 for _ in range(3)))
    POOL.keep, engine.cache.read_tail = keep, read_tail  # type: ignore[method-assign]
    print(f"\n2. A question's TTFT on the cached Albarán prefix ({len(req)} tokens, {engine.precision}), "
          f"median of {rounds} rounds\n")
    print("| buffers | TTFT (ms) |\n|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {1000 * statistics.median(ts):.1f} |")
    base = times["new buffers, the tail computed (stop 48)"]
    for name, ts in times.items():
        print(f"{name} / stop 48's: **{median_ratio(ts, base):.2f}**")
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--precision", default="bf16")
    args = ap.parse_args()
    torch.set_num_threads(2)
    store = tempfile.mkdtemp(prefix="kvfuse-decode-path-store-")
    engine = Engine.load(resolve_model_path(None), store_dir=store, precision=args.precision)
    print(f"{cpu_name()}; torch {torch.__version__}, 2 threads; {time.strftime('%Y-%m-%d %H:%M')}")
    attention(engine, args.rounds)
    ttft(engine, args.rounds, store)
    shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
