"""Whole answers against llama.cpp (issue M): the time a person waits, not only the first token.

    .venv/bin/python benchmarks/vs_llamacpp.py --setup     # once: llama-cpp-python into .bench/llamacpp
    .venv/bin/python benchmarks/answer_time.py [--precision fp32] [--rounds 5] [--tokens 24] [--skip-rag] [--out F]

One precision per run (its own process, so its peak RSS is its own). Both engines get the same token ids
(kvfuse's tokenizer, with the engine's preamble) and answer greedily a fixed number of tokens (EOS
ignored), 2 threads each, interleaved one of each per round; medians of the per-round ratios:
- **CAG**: a question on the Albarán knowledge base's support prefix (about 10k tokens). kvfuse answers
  in `prefix` mode from the stored prefix; llama.cpp keeps the same prefix in its KV cache and rolls back
  to it before each question (its server's prompt cache), then evaluates the question and decodes.
- **Quote**: the quote request that follows an answer (the answer's prompt, the answer, then `Quote: "`),
  on the same cached prefix: the model copies a source sentence, where drafts from the context pay most.
- **RAG**: MuSiQue dev case 0 with 6 passages: kvfuse's default fuser over precomputed chunk caches,
  against llama.cpp's full prefill of the same prompt.
- **ms per token** at the CAG prompt's context (about 10k tokens): (answer time - TTFT) / (tokens - 1).
kvfuse runs with drafts from the context (its default) and without (`nodraft`); acceptance rates are
the drafted tokens kept. `--temperature T` makes kvfuse sample (seed 1, the same each round) where
drafts are verified by the rejection rule (llama.cpp stays greedy: compare kvfuse's rows there), and adds
`fullhead` runs that sample from the whole float head instead of through the screen.
Peak RSS is this process's (llama.cpp runs in a worker process of its own).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, median_ratio, medians, musique_cases, musique_prompt  # noqa: E402
from vs_llamacpp import LLAMA_CPP_VERSION, LlamaCpp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

WORKER = r'''
import inspect, json, sys, time
from llama_cpp import Llama
kw = dict(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=2, n_threads_batch=2, n_batch=512, verbose=False)
if "swa_full" in inspect.signature(Llama.__init__).parameters:
    kw["swa_full"] = True  # keep every position of the sliding layers too, so a rollback finds them
llm = Llama(**kw)
for line in sys.stdin:
    cmd = json.loads(line)
    t = time.perf_counter()
    if cmd["op"] == "keep":  # evaluate a prefix once and keep it in the KV cache
        llm.reset(); llm.eval(cmd["ids"])
        out = {"s": time.perf_counter() - t}
    else:  # "answer": roll back to `keep` tokens, evaluate ids, decode greedily
        llm.n_tokens = cmd["keep"]  # eval() drops the KV cache's positions from n_tokens on
        llm.eval(cmd["ids"])
        toks = [llm.sample(top_k=1, temp=0.0)]
        first = time.perf_counter()
        while len(toks) < cmd["tokens"]:
            llm.eval(toks[-1:]); toks.append(llm.sample(top_k=1, temp=0.0))
        end = time.perf_counter()
        out = {"s": end - t, "ttft": first - t, "tokens": toks}
    print(json.dumps(out), flush=True)
'''


class Llama(LlamaCpp):
    """llama.cpp (vs_llamacpp's worker process) that keeps a prefix in its KV cache and answers after it."""

    def __init__(self, gguf: Path, n_ctx: int) -> None:
        super().__init__(gguf, WORKER, str(n_ctx))
        self.kept: list[int] = []

    def keep(self, ids: list[int]) -> None:
        self.call(op="keep", ids=ids)
        self.kept = list(ids)

    def answer(self, ids: list[int], tokens: int) -> dict:  # type: ignore[type-arg]
        """Answer after the kept prefix where ids start with it (a rollback), else from scratch."""
        keep = len(self.kept) if ids[: len(self.kept)] == self.kept else 0
        return self.call(op="answer", keep=keep, ids=ids[keep:], tokens=tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--skip-rag", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="kvfuse samples at this temperature (seeded, same seed each round) instead of greedy; "
                         "llama.cpp stays greedy, so only kvfuse's drafted/undrafted times compare")
    ap.add_argument("--out", type=Path, default=None, help="also write the raw times here (JSON)")
    args = ap.parse_args()

    import torch

    from kvfuse.checkpoints import DEFAULT_MODEL_NAME, PACKAGED, resolve_model_path
    from kvfuse.engine import Engine, Request
    from kvfuse.engine.sampling import SamplingParams
    from kvfuse.fuse import DEFAULT_MODE
    from kvfuse.kb import answer
    from kvfuse.kb.base import KnowledgeBase
    from kvfuse.kb.manifest import resolve_kb_dir
    from kvfuse.text import Tokenizer

    torch.set_num_threads(2)
    gguf = ROOT / ".bench" / "gemma3-270m-q4_k_m.gguf"
    if not gguf.is_file():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        PACKAGED[DEFAULT_MODEL_NAME].gguf(gguf)
    tmp = Path(tempfile.mkdtemp(prefix="kvfuse-answer-time-"))
    kb_dir, store = tmp / "albaran", tmp / "store"
    shutil.copytree(resolve_kb_dir("albaran"), kb_dir)
    path = resolve_model_path(None)
    tok = Tokenizer(path)
    engine = Engine.load(path, store_dir=store, precision=args.precision)
    kb = KnowledgeBase.open(kb_dir, engine, tok, state_dir=store)
    kb.build("support")
    question = "How many days does a Team plan customer have to ask for a refund on an annual renewal?"
    cag = answer.prepare(kb, question, "support").request
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=args.temperature, seed=1)
    reply = tok.decode(engine.generate(cag, "prefix", params=SamplingParams(max_tokens=args.tokens)).tokens).strip()
    quote = answer.quote_request(tok, cag, question, reply.split("\n")[0])
    rag = musique_prompt(musique_cases()[0], 6).request(tok)
    engine.precompute(rag, DEFAULT_MODE)
    pre = list(engine.preamble)

    def ids(r: Request) -> list[int]:
        return pre + list(r.ids)

    llama = Llama(gguf, n_ctx=len(ids(quote)) + args.tokens + 64)  # keeps the knowledge base's prefix
    llama.keep(pre + list(cag.prefix))
    llama_rag = Llama(gguf, n_ctx=len(ids(rag)) + args.tokens + 64)  # full prefills, beside it
    drafts: dict[str, list[float]] = {}
    same: dict[str, bool] = {}

    def kv(name: str, r: Request, mode: str, draft: bool = True, screen: bool = True):  # type: ignore[no-untyped-def]
        def run() -> float:
            engine.draft_tokens = 6 if draft else 0
            engine.scheduler.screen_samples = screen
            g = engine.generate(r, mode, params=params)
            if draft:
                drafts.setdefault(name, []).append(g.drafts.acceptance or 0.0)
            times.setdefault(f"{name} step", []).append((g.total_s - g.ttft_s) / (args.tokens - 1))
            last[name] = g.tokens
            return g.total_s
        return run

    def ll(name: str, r: Request, worker: Llama = llama):  # type: ignore[no-untyped-def]
        def run() -> float:
            out = worker.answer(ids(r), args.tokens)
            times.setdefault(f"{name} step", []).append((out["s"] - out["ttft"]) / (args.tokens - 1))
            last[name] = out["tokens"]
            return float(out["s"])
        return run

    last: dict[str, list[int]] = {}
    times: dict[str, list[float]] = {}
    fns = {"llama cag": ll("llama cag", cag), "kvfuse cag": kv("kvfuse cag", cag, "prefix"),
           "kvfuse cag nodraft": kv("kvfuse cag nodraft", cag, "prefix", False),
           "llama quote": ll("llama quote", quote), "kvfuse quote": kv("kvfuse quote", quote, "prefix"),
           "kvfuse quote nodraft": kv("kvfuse quote nodraft", quote, "prefix", False)}
    if args.temperature > 0:  # sampled through the screen (where it may) against the whole float head
        fns |= {"kvfuse cag fullhead": kv("kvfuse cag fullhead", cag, "prefix", screen=False),
                "kvfuse quote fullhead": kv("kvfuse quote fullhead", quote, "prefix", screen=False)}
    if not args.skip_rag:
        fns |= {"llama rag": ll("llama rag", rag, llama_rag), "kvfuse rag": kv("kvfuse rag", rag, DEFAULT_MODE)}
    for f in fns.values():  # warm up
        f()
    times.clear()
    drafts.clear()
    for r in range(args.rounds):
        for name, f in fns.items():
            times.setdefault(name, []).append(f())
        print(f"round {r + 1} done at {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
        for a, b in (("kvfuse cag", "kvfuse cag nodraft"), ("kvfuse quote", "kvfuse quote nodraft")):
            same[a] = same.get(a, True) and last[a] == last[b]
    llama.close()
    llama_rag.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    med = medians(times)
    cpu = cpu_name()
    print(f"\n{cpu}; torch {torch.__version__}, llama-cpp-python {LLAMA_CPP_VERSION}, 2 threads; precision "
          f"{args.precision}; {args.tokens} tokens; temperature {args.temperature}; {args.rounds} interleaved rounds; "
          f"CAG prompt {len(ids(cag))} "
          f"tokens, quote {len(ids(quote))}, RAG {len(ids(rag))}; peak RSS {peak:.0f} MiB")
    print("\n| scenario | kvfuse (s) | llama.cpp (s) | kvfuse / llama.cpp | ms/token kvfuse | ms/token llama.cpp "
          "| step ratio | draft acceptance | same tokens as llama.cpp |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [("cag", "kvfuse cag"), ("cag", "kvfuse cag nodraft"), ("quote", "kvfuse quote"),
            ("quote", "kvfuse quote nodraft")] + ([] if args.skip_rag else [("rag", "kvfuse rag")])
    if args.temperature > 0:
        rows += [("cag", "kvfuse cag fullhead"), ("quote", "kvfuse quote fullhead")]
    for scen, name in rows:
        ln = f"llama {scen}"
        acc = f"{sum(drafts[name]) / len(drafts[name]):.2f}" if name in drafts else "-"
        print(f"| {name.removeprefix('kvfuse ')} | {med[name]:.3f} | {med[ln]:.3f} | "
              f"**{median_ratio(times[name], times[ln]):.3f}** | {1000 * med[name + ' step']:.1f} | "
              f"{1000 * med[ln + ' step']:.1f} | {median_ratio(times[name + ' step'], times[ln + ' step']):.2f} | "
              f"{acc} | {last[name] == last[ln]} |")
    print(f"\ndrafts change no token (each round, drafted against not): {same}")
    if args.out:
        args.out.write_text(json.dumps({"times": times, "drafts": drafts, "peak_rss_mib": peak}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
