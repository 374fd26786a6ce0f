"""Evaluation cases in CacheBlend's format: a JSON list of {ctxs: [{title, text}], question, answers}."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """The data file cannot be used as given; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class Passage:
    title: str
    text: str

    def render(self) -> str:
        return f"{self.title}\n{self.text}".strip() if self.title else self.text.strip()


@dataclass(frozen=True, slots=True)
class Case:
    index: int  # position in the data file
    question: str
    answers: tuple[str, ...]
    passages: tuple[Passage, ...]
    kind: str = "qa"  # "qa" (scored by F1) or "summary" (scored by Rouge-L)


def _case(i: int, raw: Any, where: str) -> Case:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: case {i} is not an object with ctxs, question and answers")
    missing = [k for k in ("ctxs", "question", "answers") if k not in raw]
    if missing:
        raise DataError(f"{where}: case {i} lacks {', '.join(missing)}")
    answers = raw["answers"]
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers) or not answers:
        raise DataError(f"{where}: case {i}: answers must be a non-empty list of strings")
    ctxs = raw["ctxs"]
    if not isinstance(ctxs, list) or not ctxs:
        raise DataError(f"{where}: case {i}: ctxs must be a non-empty list of {{title, text}}")
    passages = []
    for j, c in enumerate(ctxs):
        if not isinstance(c, dict) or not isinstance(c.get("text"), str):
            raise DataError(f"{where}: case {i}, ctxs[{j}] needs a text string")
        passages.append(Passage(str(c.get("title") or ""), c["text"]))
    if not isinstance(raw["question"], str) or not raw["question"].strip():
        raise DataError(f"{where}: case {i}: question must be a non-empty string")
    kind = raw.get("kind", "summary" if _mean_words(answers) > 20 else "qa")
    return Case(i, raw["question"], tuple(answers), tuple(passages), kind)


def _mean_words(answers: list[str]) -> float:
    return sum(len(a.split()) for a in answers) / len(answers)


def cases_from(raw: list[Any], where: str) -> list[Case]:
    """Validated cases from already-parsed data (a generated set, say)."""
    return [_case(i, r, where) for i, r in enumerate(raw)]


def read_json(p: Path, flag: str, error: type[Exception] = DataError) -> Any:
    """The JSON in the file a CLI flag names, or `error` saying it cannot be read or parsed."""
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise error(f"cannot read {flag} {p}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise error(f"{flag} {p} is not valid JSON: {e}") from None


def load_cases(path: str | Path, cases: int | None = None, offset: int = 0) -> list[Case]:
    """Read, validate and select cases[offset : offset + cases]."""
    p = Path(path)
    raw = read_json(p, "--data")
    if not isinstance(raw, list):
        raise DataError(f"--data {p} must hold a JSON list of cases, got {type(raw).__name__}")
    if offset < 0 or (cases is not None and cases <= 0):
        raise DataError("--offset must be >= 0 and --cases > 0")
    if offset >= len(raw):
        raise DataError(f"--offset {offset} is past the end of {p}, which has {len(raw)} cases")
    end = len(raw) if cases is None else min(len(raw), offset + cases)
    return [_case(i, raw[i], str(p)) for i in range(offset, end)]
