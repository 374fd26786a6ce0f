"""Block hashing and TTFT of a question on the Albarán knowledge base's cached prefix, old commit vs. new tree.

    .venv/bin/python benchmarks/kb_hashing.py --old <commit> [--rounds 5] [--questions 4] [--store DIR] [--json]

For a question asked on the "support" group's cached prefix (already built and stored), it measures:

(a) how many times a block hash is computed (`kvfuse.store.keys.hash_block_tokens`, counted by a wrapper that
    replaces the module global right after kvfuse is imported) while answering one question with
    `max_tokens=1, quote=False`, and for the first question also with `max_tokens=8, quote=True` (the answer
    plus its quote request); the prefix has `tokens_total // 16` full blocks, printed alongside;
(b) the question's time to first token: the engine-measured `Answer.ttft_s` and the wall time of `kb.ask`.

The OLD side is a detached `git worktree` of --old (default HEAD) in a temp dir, removed at the end; the NEW
side is this working tree. Each round runs one fresh worker process per side, in alternating order (old first
on even rounds, new first on odd ones); figures are medians over the rounds of each worker's medians over its
questions; new/old is given as the ratio of those medians and as the median of the per-round ratios. Both
sides share one store (a temp dir unless --store), built by an untimed warm-up worker of the new tree before
the rounds (which also converts the default model on first use).

Worker mode, which the driver runs (prints one JSON line on stdout):

    .venv/bin/python benchmarks/kb_hashing.py --worker --src <tree> --store <dir> [--questions N]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16
GROUP = "support"
QUESTIONS = [
    "How many days does a Team plan customer have to ask for a refund on an annual renewal?",
    "Which plan includes single sign-on?",
    "How long are invoices kept?",
    "Can a customer pay by bank transfer?",
]
REPO = Path(__file__).resolve().parents[1]


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout.strip()


# -- worker -------------------------------------------------------------------------------------------------


def install_hash_counter(keys: Any) -> list[int]:
    """Replace keys.hash_block_tokens with a wrapper that counts its calls; returns the counter (a 1-list)."""
    original: Callable[..., Any] = keys.hash_block_tokens
    count = [0]

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    keys.hash_block_tokens = counting
    return count


def worker(src: Path, store: Path, n_questions: int) -> dict[str, Any]:
    sys.path.insert(0, str(src))
    import kvfuse
    import kvfuse.store.keys as keys

    assert Path(kvfuse.__file__).resolve().is_relative_to(src), f"kvfuse imported from {kvfuse.__file__}, not {src}"
    count = install_hash_counter(keys)  # before anything is loaded

    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.engine import Engine
    from kvfuse.kb.base import KnowledgeBase
    from kvfuse.text import Tokenizer

    path = resolve_model_path(None)
    engine = Engine.load(path, store_dir=store)
    tok = Tokenizer(path)
    kb = KnowledgeBase.open("albaran", engine, tok, state_dir=store)
    report = kb.build(GROUP)
    questions = QUESTIONS[:n_questions]
    kb.ask(questions[0], GROUP, max_tokens=1, quote=False)  # warm-up, untimed

    per_question: list[dict[str, Any]] = []
    for q in questions:
        count[0] = 0
        t0 = time.perf_counter()
        a = kb.ask(q, GROUP, max_tokens=1, quote=False)
        wall = time.perf_counter() - t0
        per_question.append({"hashes": count[0], "wall_s": wall, "ttft_s": a.ttft_s})

    count[0] = 0
    quoted = kb.ask(questions[0], GROUP, max_tokens=8, quote=True)
    hashes_with_quote = count[0]

    try:
        commit = git(src, "rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        commit = "worktree"
    return {
        "src": str(src),
        "commit": commit,
        "blocks": report.tokens_total // BLOCK_SIZE,
        "tokens_total": report.tokens_total,
        "per_question": per_question,
        "hashes_with_quote": hashes_with_quote,
        "quote_answer": quoted.answer,  # the quote request is only made when this is not empty
        "median_wall_s": statistics.median(p["wall_s"] for p in per_question),
        "median_ttft_s": statistics.median(p["ttft_s"] for p in per_question),
        "median_hashes": statistics.median(p["hashes"] for p in per_question),
    }


# -- driver -------------------------------------------------------------------------------------------------


def run_worker(tree: Path, store: Path, n_questions: int) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--src", str(tree), "--store", str(store),
           "--questions", str(n_questions)]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise RuntimeError(f"worker for {tree} failed with exit status {proc.returncode}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        sys.stderr.write(proc.stderr)
        raise RuntimeError(f"worker for {tree} printed nothing on stdout")
    return json.loads(lines[-1])


def current_commit(tree: Path) -> str:
    commit = git(tree, "rev-parse", "HEAD")
    return commit + ("+dirty" if git(tree, "status", "--porcelain") else "")


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "median_wall_s": statistics.median(r["median_wall_s"] for r in results),
        "median_ttft_s": statistics.median(r["median_ttft_s"] for r in results),
        "hashes_per_question": statistics.median(r["median_hashes"] for r in results),
        "hashes_with_quote": statistics.median(r["hashes_with_quote"] for r in results),
        "blocks": results[0]["blocks"],
        "commit": results[0]["commit"],
        "rounds_wall_s": [r["median_wall_s"] for r in results],
        "rounds_ttft_s": [r["median_ttft_s"] for r in results],
    }


def driver(old_rev: str, rounds: int, n_questions: int, store_arg: Path | None) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kvfuse-kb-hashing-"))
    old_tree = tmp / "old"
    store = store_arg.resolve() if store_arg is not None else tmp / "store"
    store.mkdir(parents=True, exist_ok=True)
    new_commit = current_commit(REPO)
    added = False
    try:
        git(REPO, "worktree", "add", "--detach", str(old_tree), old_rev)
        added = True
        old_commit = git(old_tree, "rev-parse", "HEAD")
        print(f"warm-up worker (new tree) building the kb prefix in {store} ...", file=sys.stderr, flush=True)
        run_worker(REPO, store, n_questions)
        results: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
        trees = {"old": old_tree, "new": REPO}
        for r in range(rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for side in order:
                results[side].append(run_worker(trees[side], store, n_questions))
            print(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{s} ttft {results[s][-1]['median_ttft_s'] * 1e3:.1f} ms "
                f"hashes {results[s][-1]['median_hashes']:g}" for s in ("old", "new")), file=sys.stderr, flush=True)
    finally:
        if added:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old_tree)],
                           capture_output=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)  # the store too, unless --store put it elsewhere
    new_commit_end = current_commit(REPO)
    if new_commit_end != new_commit:  # others may commit while it runs: the new side was not one version
        print(f"warning: the working tree went from {new_commit} to {new_commit_end} during the run",
              file=sys.stderr)
    old, new = summarize(results["old"]), summarize(results["new"])
    old["commit"], new["commit"] = old_commit, new_commit
    return {
        "old": old,
        "new": new,
        "ratio_wall_new_old": new["median_wall_s"] / old["median_wall_s"],
        "ratio_ttft_new_old": new["median_ttft_s"] / old["median_ttft_s"],
        # median of the per-round new/old ratios: each pair ran back to back, so less hurt by the machine's drift
        "paired_ratio_wall_new_old": statistics.median(
            n / o for n, o in zip(new["rounds_wall_s"], old["rounds_wall_s"], strict=True)),
        "paired_ratio_ttft_new_old": statistics.median(
            n / o for n, o in zip(new["rounds_ttft_s"], old["rounds_ttft_s"], strict=True)),
        "rounds": rounds,
        "questions": n_questions,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"node": platform.node(), "cpu_count": os.cpu_count()},
        "old_commit": old_commit,
        "new_commit": new_commit,
        "new_commit_end": new_commit_end,
    }


def print_table(out: dict[str, Any]) -> None:
    print(f"kb albaran, group {GROUP}: {out['questions']} questions, {out['rounds']} rounds, {out['date']}, "
          f"{out['machine']['node']} ({out['machine']['cpu_count']} CPUs)")
    print(f"{'side':<5} {'commit':<20} {'blocks':>6} {'hashes/q':>9} {'w/ quote':>9} {'wall ms':>9} {'ttft ms':>9}")
    for side in ("old", "new"):
        s = out[side]
        commit = s["commit"][:12] + ("+dirty" if s["commit"].endswith("+dirty") else "")
        print(f"{side:<5} {commit:<20} {s['blocks']:>6} {s['hashes_per_question']:>9g} "
              f"{s['hashes_with_quote']:>9g} {s['median_wall_s'] * 1e3:>9.1f} {s['median_ttft_s'] * 1e3:>9.1f}")
    print(f"new/old: wall {out['ratio_wall_new_old']:.3f}, ttft {out['ratio_ttft_new_old']:.3f} (ratio of medians); "
          f"paired per round: wall {out['paired_ratio_wall_new_old']:.3f}, ttft {out['paired_ratio_ttft_new_old']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="HEAD", help="the git revision to compare the working tree against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--questions", type=int, default=len(QUESTIONS), choices=range(1, len(QUESTIONS) + 1))
    ap.add_argument("--store", type=Path, default=None, help="store dir shared by both sides (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--src", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        if args.src is None or args.store is None:
            ap.error("--worker needs --src and --store")
        stdout = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the one JSON line
            out = worker(args.src.resolve(), args.store.resolve(), args.questions)
        print(json.dumps(out), file=stdout, flush=True)
        return

    out = driver(args.old, args.rounds, args.questions, args.store)
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)


if __name__ == "__main__":
    main()
