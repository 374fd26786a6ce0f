"""Peak memory phase by phase: the flow of `answer_time.py` in one process, at one precision (stop 51).

    .venv/bin/python benchmarks/rss_phases.py --precision bf16     # then --precision fp32, to compare

Loads the tokenizer and the engine, builds the Albarán knowledge base's support prefix (about 10k
tokens), answers a question on it twice, precomputes and answers a 6-passage MuSiQue prompt, and prints
this process's resident memory (VmRSS) and its peak so far (VmHWM) after each phase.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, musique_cases, musique_prompt  # noqa: E402


def mem(tag: str) -> None:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
                  if line.startswith(("VmRSS", "VmHWM")))
    rss, peak = (int(status[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM"))
    print(f"| {tag} | {rss} | {peak} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="bf16")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    print(f"{cpu_name()}; torch {torch.__version__}; precision {args.precision}\n")
    print("| after | RSS (MiB) | peak so far (MiB) |\n|---|---|---|")
    mem("torch imported")
    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.engine import Engine
    from kvfuse.engine.sampling import SamplingParams
    from kvfuse.fuse import DEFAULT_MODE
    from kvfuse.kb import answer
    from kvfuse.kb.base import KnowledgeBase
    from kvfuse.kb.manifest import resolve_kb_dir
    from kvfuse.text import Tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="kvfuse-rss-"))
    kb_dir, store = tmp / "albaran", tmp / "store"
    shutil.copytree(resolve_kb_dir("albaran"), kb_dir)
    path = resolve_model_path(None)
    tok = Tokenizer(path)
    mem("tokenizer")
    engine = Engine.load(path, store_dir=store, precision=args.precision)
    mem("engine loaded")
    kb = KnowledgeBase.open(kb_dir, engine, tok, state_dir=store)
    kb.build("support")
    mem("knowledge base built")
    question = "How many days does a Team plan customer have to ask for a refund on an annual renewal?"
    cag = answer.prepare(kb, question, "support").request
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for tag in ("CAG answered", "CAG answered again"):
        engine.generate(cag, "prefix", params=params)
        mem(tag)
    rag = musique_prompt(musique_cases()[0], 6).request(tok)
    engine.precompute(rag, DEFAULT_MODE)
    mem("RAG precomputed")
    engine.generate(rag, DEFAULT_MODE, params=params)
    mem("RAG answered")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
