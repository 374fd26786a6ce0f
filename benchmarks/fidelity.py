"""Fidelity to fp32 of each precision and of llama.cpp's Q4_K_M, on the same cases in one run (issue M, point 6).

    .venv/bin/python benchmarks/fidelity.py [--precisions int8,w8a8] [--cases 20] [--passages 6] [--tokens 16]

For each MuSiQue dev case (its first `--passages` passages and its question, kvfuse's tokenizer and
preamble for every engine): kvfuse fp32 prefills the prompt in full and decodes `--tokens` greedy tokens;
every other engine is then teacher-forced on that same continuation (kvfuse: `generate(score=...)`;
llama.cpp: one `eval` of prompt and continuation with every position's logits kept). Reported against
fp32, per engine: first-token agreement, the mean KL(fp32 || engine) of the first token, and the mean
teacher-forced KL over all the continuation's positions (mean over cases of the mean over positions),
with the cases where the engine's argmax differs from fp32's anywhere along it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import musique_cases, musique_prompt  # noqa: E402
from vs_llamacpp import LlamaCpp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

WORKER = r'''
import json, sys
import numpy as np
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=2, n_threads_batch=2, n_batch=512,
            logits_all=True, verbose=False)
for line in sys.stdin:
    cmd = json.loads(line)
    llm.reset(); llm.eval(cmd["ids"])
    np.save(cmd["out"], np.asarray(llm.scores[cmd["lo"] : cmd["hi"]], dtype=np.float32))
    print("{}", flush=True)
'''


def kl(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per row of (rows, vocab) logits."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(other.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="int8,w8a8")
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from kvfuse.checkpoints import DEFAULT_MODEL_NAME, PACKAGED, resolve_model_path
    from kvfuse.engine import Engine
    from kvfuse.engine.sampling import SamplingParams
    from kvfuse.text import Tokenizer

    torch.set_num_threads(2)
    path = resolve_model_path(None)
    tok = Tokenizer(path)
    cases = musique_cases()[: args.cases]
    reqs = [musique_prompt(c, args.passages).request(tok) for c in cases]
    # fp32: the reference logits along its own greedy continuation
    fp32 = Engine.load(path, precision="fp32")
    pre = list(fp32.preamble)
    conts, refs = [], []
    for r in reqs:
        g = fp32.generate(r, "full", params=SamplingParams(max_tokens=args.tokens, ignore_eos=True))
        cont = g.tokens
        s = fp32.generate(r, "full", params=SamplingParams(max_tokens=1), score=cont)
        assert s.scored_logits is not None
        conts.append(cont)
        refs.append(s.scored_logits)
    del fp32
    logits: dict[str, list[torch.Tensor]] = {}
    for p in [x for x in args.precisions.split(",") if x]:
        e = Engine.load(path, precision=p)
        logits[p] = []
        for r, cont in zip(reqs, conts, strict=True):
            s = e.generate(r, "full", params=SamplingParams(max_tokens=1), score=cont)
            assert s.scored_logits is not None
            logits[p].append(s.scored_logits)
        del e
        print(f"{p} done at {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
    if not args.no_llama:
        gguf = ROOT / ".bench" / "gemma3-270m-q4_k_m.gguf"
        if not gguf.is_file():
            gguf.parent.mkdir(parents=True, exist_ok=True)
            PACKAGED[DEFAULT_MODEL_NAME].gguf(gguf)
        n_ctx = max(len(r.ids) for r in reqs) + len(pre) + args.tokens + 16
        llama = LlamaCpp(gguf, WORKER, str(n_ctx))
        logits["llama.cpp Q4_K_M"] = []
        with tempfile.TemporaryDirectory() as tmp:
            for r, cont in zip(reqs, conts, strict=True):
                n = len(pre) + len(r.ids)
                llama.call(ids=pre + list(r.ids) + cont[:-1], lo=n - 1, hi=n - 1 + len(cont), out=f"{tmp}/s.npy")
                logits["llama.cpp Q4_K_M"].append(torch.from_numpy(np.load(f"{tmp}/s.npy")))
        llama.close()
    print(f"\n{len(reqs)} MuSiQue dev cases, {args.passages} passages, {args.tokens} teacher-forced tokens "
          f"(fp32's greedy continuation); prompts {min(len(r.ids) for r in reqs)}-{max(len(r.ids) for r in reqs)} "
          "tokens\n")
    print("| engine | first-token agreement | first-token KL (mean) | teacher-forced KL (mean) | "
          "teacher-forced KL (median case) | cases with a differing argmax along the continuation |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for name, rows in logits.items():
        first = [int(x[0].argmax()) == int(ref[0].argmax()) for x, ref in zip(rows, refs, strict=True)]
        k0 = [float(kl(ref[:1], x[:1].float())[0]) for x, ref in zip(rows, refs, strict=True)]
        ks = [float(kl(ref, x.float()).mean()) for x, ref in zip(rows, refs, strict=True)]
        differ = sum(bool((x.argmax(-1) != ref.argmax(-1)).any()) for x, ref in zip(rows, refs, strict=True))
        summary[name] = {"agreement": sum(first) / len(first), "kl_first": float(np.mean(k0)),
                         "kl_forced": float(np.mean(ks)), "kl_forced_median": float(np.median(ks)), "differ": differ}
        print(f"| {name} | {sum(first)}/{len(first)} | {np.mean(k0):.4f} | {np.mean(ks):.4f} | "
              f"{np.median(ks):.4f} | {differ} |")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
