"""Issue J: how well the answer checks work on the Albarán knowledge base.

1. The conflict check on the 62 bundled questions: of the answers that state a quantity (a number with a
   unit), how many wrong ones get a conflict flag (caught), and how many right ones get one (false flags).
   "Right" is the compare harness's measure: the answer contains one of the question's gold answers.
   The answers are either computed now (`--run`, CAG on the default model, as `kvfuse ask` answers) or
   read from a `kvfuse compare` output (`--answers compare.json`: every method's recorded answer).
2. The `supports` rule on the hand-labelled examples in tests/data/supports.json.

    python benchmarks/conflicts.py --answers docs/compare-issue-l/compare.json
    python benchmarks/conflicts.py --run
    python benchmarks/conflicts.py --qualified benchmarks/data/qualified_conflicts.json

3. `--qualified`: questions that name a plan or a billing period (issue Q.3), each with a right and a wrong
   answer labelled by hand from the Albarán documents: the wrong value is another plan's or period's, so
   a check that ignores the question's qualifiers finds support or conflict in the wrong case.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def recorded(path: Path) -> list[tuple[str, dict[str, Any], str]]:
    """(method, question, answer) for every method's answer in a `kvfuse compare` output."""
    data = json.loads(path.read_text())
    return [(m, q, rec["answer"]) for q in data["per_question"] for m, rec in q["methods"].items()]


def computed(model: str | None) -> list[tuple[str, dict[str, Any], str]]:
    """CAG answers computed now, one per bundled question (no quote request: only the answer is needed)."""
    from kvfuse.runtime import bundled, open_engine, open_kb, store_dir

    rt = open_engine(model, store_dir(None))
    kb = open_kb(bundled("albaran"), rt, store_dir(None))
    questions = json.loads((ROOT / "kvfuse" / "data" / "albaran" / "questions.json").read_text())
    out = []
    for q in questions:
        a = kb.ask(q["question"], q["group"], quote=False)
        out.append(("cag", q, a.answer))
        print(f"{q['id']}: {a.answer!r}", flush=True)
    return out


def qualified(path: Path) -> list[tuple[str, dict[str, Any], str]]:
    """Each labelled question twice: with its right answer and with its wrong one."""
    rows = []
    for q in json.loads(path.read_text()):
        rows += [("qualified", {**q, "answers": [q["right"]], "label": True}, q["right"]),
                 ("qualified", {**q, "answers": [q["right"]], "label": False}, q["wrong"])]
    return rows


def conflicts(rows: list[tuple[str, dict[str, Any], str]]) -> dict[str, Any]:
    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.eval.metrics import contains_gold
    from kvfuse.kb.conflicts import conflicts_for
    from kvfuse.kb.facts import quantities
    from kvfuse.kb.manifest import load_manifest
    from kvfuse.runtime import bundled
    from kvfuse.text.tokenizer import Tokenizer

    class Docs:  # what conflicts_for reads of a knowledge base
        manifest = load_manifest(bundled("albaran"))
        tok = Tokenizer(resolve_model_path(None))

    table: dict[str, dict[str, int]] = {}
    examples = []
    for method, q, answer in rows:
        if not quantities(answer):
            continue
        flagged = conflicts_for(Docs, q["group"], q["question"], answer)  # type: ignore[arg-type]
        right = q["label"] if "label" in q else contains_gold(answer, q["answers"])
        t = table.setdefault(method, {"wrong": 0, "wrong_flagged": 0, "right": 0, "right_flagged": 0})
        key = "right" if right else "wrong"
        t[key] += 1
        t[f"{key}_flagged"] += bool(flagged)
        if flagged and len(examples) < 12:
            examples.append({"id": q["id"], "method": method, "answer": answer, "right": right,
                             "conflict": flagged[0].as_dict()})
    total = {k: sum(t[k] for t in table.values()) for k in ("wrong", "wrong_flagged", "right", "right_flagged")}
    for t in [*table.values(), total]:
        t["catch_rate"] = round(t["wrong_flagged"] / t["wrong"], 3) if t["wrong"] else None  # type: ignore[assignment]
        t["false_flag_rate"] = round(t["right_flagged"] / t["right"], 3) if t["right"] else None  # type: ignore[assignment]
        flagged = t["wrong_flagged"] + t["right_flagged"]  # precision: the flags that are on wrong answers
        t["precision"] = round(t["wrong_flagged"] / flagged, 3) if flagged else None  # type: ignore[assignment]
    return {"by_method": table, "all": total, "examples": examples}


def supports_accuracy() -> dict[str, Any]:
    from kvfuse.kb.manifest import load_manifest
    from kvfuse.kb.quotes import find_quote, judge
    from kvfuse.runtime import bundled

    docs = load_manifest(bundled("albaran")).documents
    labelled = json.loads((ROOT / "tests" / "data" / "supports.json").read_text())
    agree = 0
    for ex in labelled:
        cited = find_quote(ex["quote"], [d for d in docs if d.id == ex["doc"]])
        agree += judge(cited, ex["answer"], docs).supports is ex["supports"]
    return {"examples": len(labelled), "agree": agree, "accuracy": round(agree / len(labelled), 3),
            "labelled_supports": sum(e["supports"] for e in labelled)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--answers", type=Path, help="a `kvfuse compare` output (compare.json)")
    src.add_argument("--run", action="store_true", help="answer the 62 questions now (CAG, default model)")
    src.add_argument("--qualified", type=Path, help="labelled right and wrong answers (qualified_conflicts.json)")
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    rows = (recorded(args.answers) if args.answers else qualified(args.qualified) if args.qualified
            else computed(args.model))
    result = {"answers": str(args.answers or args.qualified or "computed (cag)"),
              "conflicts": conflicts(rows), "supports": supports_accuracy()}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
