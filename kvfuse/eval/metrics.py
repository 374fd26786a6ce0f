"""Answer metrics (LongBench's QA F1 and Rouge-L) and fidelity to full prefill (teacher-forced)."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from kvfuse.metrics import kl_divergence

_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """LongBench / SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(prediction: str, reference: str) -> float:
    """Token-level F1 between normalised strings (LongBench's qa_f1_score)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, answers: Sequence[str]) -> float:
    return max((token_f1(prediction, a) for a in answers), default=0.0)


def rouge_l(prediction: str, reference: str) -> float:
    """Rouge-L F-measure (rouge-score, stemmed)."""
    return float(_scorer().score(reference, prediction)["rougeL"].fmeasure) if prediction and reference else 0.0


def best_rouge_l(prediction: str, answers: Sequence[str]) -> float:
    return max((rouge_l(prediction, a) for a in answers), default=0.0)


@lru_cache(maxsize=1)
def _scorer() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def contains_gold(prediction: str, answers: Sequence[str]) -> bool:
    """Whether some gold answer occurs in the prediction, after normalisation."""
    p = f" {normalize_answer(prediction)} "
    return any(f" {normalize_answer(a)} " in p for a in answers if normalize_answer(a))


@dataclass(frozen=True, slots=True)
class Fidelity:
    first_token_agreement: float  # 1.0 if the method's first greedy token is full's, else 0.0
    token_agreement: float  # share of answer positions where the method's argmax is full's token
    kl: float  # mean over answer positions of KL(full || method)


def fidelity(reference: torch.Tensor, method: torch.Tensor, answer: Sequence[int]) -> Fidelity:
    """Compare teacher-forced logits (n, vocab) of full and of a method on full's greedy answer."""
    n = len(answer)
    if n == 0 or reference.shape[0] < n or method.shape[0] < n:
        raise ValueError(f"need logits for all {n} answer tokens (got {reference.shape[0]} and {method.shape[0]})")
    reference, method = reference[:n].cpu(), method[:n].cpu()  # from whatever device the model ran on
    target = torch.tensor(list(answer))
    pred = method.argmax(-1)
    kls = [kl_divergence(reference[i], method[i]) for i in range(n)]
    return Fidelity(float(pred[0] == target[0]), float((pred == target).float().mean()), sum(kls) / n)
