"""`kvfuse eval`: retrieve as CacheBlend does, answer each case with every method, score, and report.

Per case: the passages ("title\\ntext") are packed into chunks of at most `chunk_tokens` tokens, the
`top_k` chunks nearest the question (L2 over all-MiniLM-L6-v2 embeddings) are kept in retrieval order,
and every method answers from them. `full` always runs first: its greedy answer is the reference that
the other methods are teacher-forced on. Each case starts from an empty in-memory store, so no method
profits from another case's caches; a method's own caches are precomputed before its timed request.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfuse.engine.core import Engine, RequestError
from kvfuse.engine.sampling import SamplingParams
from kvfuse.eval.data import Case
from kvfuse.eval.methods import CaseRun, Full, Method, Outcome
from kvfuse.eval.metrics import best_f1, best_rouge_l, fidelity, token_f1
from kvfuse.rag.chunking import pack
from kvfuse.rag.dense import top_k_l2
from kvfuse.store.tiered import TieredStore
from kvfuse.text import Tokenizer

METRICS = ("f1", "rouge_l", "first_token_agreement", "token_agreement", "kl", "answer_agreement_f1")


@dataclass(frozen=True, slots=True)
class EvalSettings:
    top_k: int = 6
    chunk_tokens: int = 512
    max_tokens: int = 32


def retrieve(case: Case, tok: Tokenizer, top_k: int, chunk_tokens: int) -> tuple[str, ...]:
    """The case's top_k chunks by L2 distance to the question, nearest first."""
    chunks = pack([p.render() for p in case.passages], tok, chunk_tokens)
    return tuple(chunks[i] for i in top_k_l2(case.question, chunks, top_k))


def score_case(case: Case, full: Outcome, outcome: Outcome, reference: Sequence[int]) -> dict[str, float]:
    n = len(reference)
    assert full.scored is not None and outcome.scored is not None
    fid = fidelity(full.scored[:n], outcome.scored[:n], reference)
    return {
        "f1": best_f1(outcome.answer, case.answers),
        "rouge_l": best_rouge_l(outcome.answer, case.answers),
        "first_token_agreement": fid.first_token_agreement,
        "token_agreement": fid.token_agreement,
        "kl": fid.kl,
        "answer_agreement_f1": token_f1(outcome.answer, full.answer) if full.answer or outcome.answer else 1.0,
    }


def run_case(engine: Engine, tok: Tokenizer, case: Case, methods: Sequence[Method], s: EvalSettings,
             progress: Any = None) -> dict[str, Any]:
    engine.store = TieredStore()  # a fresh memory store per case
    chunks = retrieve(case, tok, s.top_k, s.chunk_tokens)
    run = CaseRun(engine, tok, case, chunks, SamplingParams(max_tokens=s.max_tokens))
    row: dict[str, Any] = {"index": case.index, "question": case.question, "answers": list(case.answers),
                           "chunk_tokens": [len(tok.encode(c)) for c in chunks], "methods": {}}
    full = Full().run(run)
    run.reference = tuple(full.answer_ids)
    row["prompt_tokens"] = len(run.prompt().request(tok))
    for m in methods:
        try:
            out = full if m.name == "full" else m.run(run)
        except RequestError as e:
            row["methods"][m.name] = {"error": str(e)}
            continue
        finally:
            if progress is not None:
                progress.update(1)
        rec: dict[str, Any] = {"answer": out.answer, **score_case(case, full, out, run.reference),
                               "ttft_s": out.ttft_s, "recomputed_fraction": out.recomputed_fraction,
                               "computed_fraction": out.computed_fraction}
        rec.update({k: v for k, v in out.extra.items() if k != "summaries"})
        row["methods"][m.name] = rec
    return row


def summarize(per_case: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        recs = [c["methods"][name] for c in per_case if "error" not in c["methods"].get(name, {"error": 1})]
        errors = sum(1 for c in per_case if "error" in c["methods"].get(name, {}))
        if not recs:
            out[name] = {"n": 0, "errors": errors}
            continue
        agg: dict[str, Any] = {k: statistics.mean(r[k] for r in recs) for k in METRICS}
        ttft = [r["ttft_s"] for r in recs]
        agg["ttft_s_median"], agg["ttft_s_mean"] = statistics.median(ttft), statistics.mean(ttft)
        pairs = [(c["methods"][name]["ttft_s"], c["methods"]["full"]["ttft_s"]) for c in per_case
                 if "ttft_s" in c["methods"].get(name, {}) and "ttft_s" in c["methods"].get("full", {})]
        # per case, method and full ran back to back: the median ratio is robust to the machine's drift
        agg["ttft_ratio_to_full_median"] = statistics.median(a / b for a, b in pairs) if pairs else None
        agg["recomputed_fraction"] = statistics.mean(r["recomputed_fraction"] for r in recs)
        agg["computed_fraction"] = statistics.mean(r["computed_fraction"] for r in recs)
        agg["n"], agg["errors"] = len(recs), errors
        out[name] = agg
    return out


def run_eval(engine: Engine, tok: Tokenizer, cases: Sequence[Case], methods: Sequence[Method], s: EvalSettings,
             model: str, data: str, progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    names = ["full"] + [m.name for m in methods if m.name != "full"]
    bar = tqdm(total=len(cases) * len(methods), desc="eval", unit="answer", disable=not progress)
    per_case = []
    try:
        for case in cases:
            bar.set_postfix_str(f"case {case.index}")
            per_case.append(run_case(engine, tok, case, methods, s, bar))
    finally:
        bar.close()
    return {"model": model, "data": data, "cases": len(cases), "top_k": s.top_k, "chunk_tokens": s.chunk_tokens,
            "max_tokens": s.max_tokens, "methods": summarize(per_case, names), "per_case": per_case}


def write_outputs(results: dict[str, Any], out: Path) -> list[Path]:
    from kvfuse.eval.report import fidelity_vs_ttft, quality_vs_ttft, ratio_sensitivity, report_md

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "report.md"]
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1), encoding="utf-8")
    tmp.replace(paths[0])
    paths[1].write_text(report_md(results), encoding="utf-8")
    paths.append(quality_vs_ttft(results, out / "quality_vs_ttft.png"))
    pareto = fidelity_vs_ttft(results, out / "fidelity_vs_ttft.png")
    if pareto is not None:
        paths.append(pareto)
    sens = ratio_sensitivity(results, out / "ratio_sensitivity.png")
    if sens is not None:
        paths.append(sens)
    return paths
