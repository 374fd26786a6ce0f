"""A generated cross-chunk QA set, in CacheBlend's data format.

Most answers need facts from two different passages (the seed's "13 vs 8": one passage gives one
number, another gives the other, and only cross-attention relates them); some questions are
single-passage controls. Every passage is 300-500 tokens of filler around at most one fact, and the
other passages carry distractor facts of the same shape about other entities. Everything is made up
from word lists and a seed, so the set is reproducible and no model has seen it.

Question kinds:
  compare  two passages give counts for two clubs; which has more?     answer: a club
  bridge   one passage gives a person's birth town, another the town's province;
           in which province was the person born?                        answer: a province
  control  one passage gives a person's birth town; where was she born?  answer: a town
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

TokenCount = Callable[[str], int]
MIN_TOKENS, MAX_TOKENS = 300, 500
KINDS = ("compare", "bridge", "control")

_FIRST = ("Alda", "Berin", "Calla", "Doran", "Elsin", "Farah", "Goran", "Hesta", "Ivo", "Jorun", "Kesia", "Lior",
          "Mirel", "Nadia", "Orin", "Petra", "Quill", "Rosa", "Soren", "Talia", "Ulric", "Vesna", "Wren", "Yara")
_LAST = ("Abernath", "Brask", "Corvel", "Dunmore", "Esk", "Falloway", "Grint", "Holloway", "Istre", "Jarn",
         "Kettering", "Lowick", "Marsh", "Norrow", "Oakes", "Pell", "Quarry", "Rook", "Selden", "Thorne")
_TOWNS = ("Ambry", "Belwick", "Carrow", "Dunhollow", "Eastmere", "Fennick", "Glimford", "Harrowgate", "Ilsby",
          "Jessop", "Kilnworth", "Larkfield", "Mossby", "Northam", "Orlen", "Pembry", "Quenby", "Redstow", "Saltry",
          "Tillbury", "Umberleigh", "Vantry", "Wexcombe", "Yarrowby")
_PROVINCES = ("Calder", "Drummond", "Everly", "Fairhaven", "Galloway", "Highmoor", "Kestrel", "Lindmark",
              "Morrow", "Northfell", "Oxley", "Pryor", "Ravensworth", "Stanmore", "Thistledown", "Westvale")
_CLUBS = ("Ambry Rovers", "Belwick Athletic", "Carrow United", "Dunhollow Town", "Eastmere Wanderers",
          "Fennick Albion", "Glimford City", "Harrowgate Rangers", "Ilsby Harriers", "Jessop County",
          "Kilnworth Miners", "Larkfield Swifts", "Mossby Dons", "Northam Villa", "Orlen Corinthians")
_NOUNS = ("market", "library", "harbour", "bridge", "mill", "orchard", "chapel", "school", "railway station",
          "museum", "square", "brewery", "theatre", "lighthouse", "garden", "archive")
_ADJ = ("old", "busy", "quiet", "restored", "famous", "small", "large", "modern", "historic", "narrow")
_TRADE = ("wool", "timber", "salt", "glass", "cider", "copper", "linen", "pottery", "barley", "slate")
_MONTH = ("January", "March", "April", "June", "August", "September", "October", "December")


def _an(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def _filler(rng: random.Random, subject: str) -> str:
    """One sentence of plausible, fact-free local colour about the subject."""
    n, a, t = rng.choice(_NOUNS), rng.choice(_ADJ), rng.choice(_TRADE)
    y = rng.randint(1700, 1990)
    templates = (
        f"Visitors to {subject} often mention the {a} {n}, which was rebuilt in {y}.",
        f"For much of the nineteenth century the local economy around {subject} depended on the {t} trade.",
        f"Each {rng.choice(_MONTH)} a fair is held near the {n}, drawing traders from the surrounding villages.",
        f"Local historians have written at length about the {a} {n} and the families who kept it running.",
        f"{_an(a).capitalize()} {n} stands at the edge of the settlement, and a path leads from it towards the hills.",
        f"Records from {y} describe disputes over the {t} works and the right to use the river.",
        f"The {n} was used as a meeting place during the winter of {y}, according to parish records.",
        f"Several painters of the period chose the {a} {n} as a subject, and some of their work survives.",
        f"By {y} the road past the {n} had been widened to carry carts loaded with {t}.",
        f"Today the area is mostly residential, although {_an(a)} {n} still attracts walkers at weekends.",
    )
    return rng.choice(templates)


def _passage(rng: random.Random, subject: str, fact: str, count: TokenCount) -> str:
    """Filler around one fact, grown until the passage is within [MIN_TOKENS, MAX_TOKENS] tokens."""
    before: list[str] = []
    after: list[str] = []
    while True:
        text = " ".join(before + [fact] + after)
        n = count(text)
        if n >= MIN_TOKENS:
            break
        (before if rng.random() < 0.4 else after).append(_filler(rng, subject))
    while count(text) > MAX_TOKENS and (before or after):
        (after or before).pop()
        text = " ".join(before + [fact] + after)
    return text


def _words(text: str) -> int:
    return round(len(text.split()) * 1.3)  # a rough token count when no tokenizer is given


def _person(rng: random.Random, used: set[str]) -> str:
    while True:
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        if name not in used:
            used.add(name)
            return name


def _case(rng: random.Random, kind: str, count: TokenCount, n_passages: int) -> dict[str, Any]:
    towns = rng.sample(_TOWNS, n_passages)
    provinces = rng.sample(_PROVINCES, n_passages)
    people: set[str] = set()
    ctxs: list[dict[str, str]] = []
    if kind == "compare":
        clubs = rng.sample(_CLUBS, n_passages)
        wins = rng.sample(range(2, 30), n_passages)
        for club, w in zip(clubs, wins, strict=True):
            fact = f"The {club} have won the national cup {w} times."
            ctxs.append({"title": club, "text": _passage(rng, f"the {club} ground", fact, count)})
        a, b = 0, 1
        question = f"Which club has won the national cup more times, the {clubs[a]} or the {clubs[b]}?"
        answer = clubs[a] if wins[a] > wins[b] else clubs[b]
        gold = [a, b]
    else:
        persons = [_person(rng, people) for _ in range(n_passages)]
        half = n_passages // 2
        for i in range(half):  # people and their birth towns
            fact = f"{persons[i]} was born in the town of {towns[i]}."
            ctxs.append({"title": persons[i], "text": _passage(rng, towns[i], fact, count)})
        for i in range(half, n_passages):  # towns and their provinces; town i - half is the first half's
            t = towns[i - half]
            fact = f"The town of {t} lies in the province of {provinces[i - half]}."
            ctxs.append({"title": t, "text": _passage(rng, t, fact, count)})
        if kind == "bridge":
            question = f"In which province is the town where {persons[0]} was born?"
            answer, gold = provinces[0], [0, half]
        else:
            question = f"In which town was {persons[0]} born?"
            answer, gold = towns[0], [0]
    order = list(range(len(ctxs)))
    rng.shuffle(order)
    shuffled = [ctxs[i] for i in order]
    return {"ctxs": shuffled, "question": question, "answers": [answer], "kind_of_question": kind,
            "gold_passages": sorted(order.index(g) for g in gold)}


def make_cases(n: int, seed: int, count: TokenCount | None = None, n_passages: int = 8,
               kinds: tuple[str, ...] = ("compare", "compare", "bridge", "control")) -> list[dict[str, Any]]:
    """n cases; kinds cycle in the given proportions (default: half compare, a quarter bridge, a quarter
    single-passage controls). `count` measures passages in tokens (default: a word-based estimate)."""
    if n_passages < 2 or n_passages % 2:
        raise ValueError("n_passages must be an even number of at least 2")
    rng = random.Random(seed)
    return [_case(rng, kinds[i % len(kinds)], count or _words, n_passages) for i in range(n)]
