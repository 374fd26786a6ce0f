"""What an answer states, read in code: quantities (a number with its unit), named entities and key terms;
and the rule that says whether a passage supports an answer. Pure text functions, no model.

A quantity is a number (digits, or a number word up to ninety) next to a unit of a known family: days
(calendar, business, working), hours, minutes, weeks, months, years, seats, users, invoices, GB,
percent and euros (`€12`, `12 €`, `12 euros`, `EUR 12`). `14-day` is 14 days.

The support rule (docs/design.md, "Citations that support the answer"): a passage supports an answer when

1. every quantity the answer states is stated in the passage (same value, same unit family); and
2. every named entity of the answer (a capitalised word that does not start a sentence) occurs in it; and
3. when the answer states no quantity, at least half of its key terms (words of four letters or more,
   not stop words, compared by a crude stem) occur in it.

An answer with none of the three (a bare "Yes.") states nothing a passage could be checked against: it
is never reported as supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NUMBER_WORDS = {
    "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
    "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17,
    "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60,
    "ninety": 90, "a hundred": 100,
}
UNITS = {  # unit spelling -> family
    "calendar days": "days", "calendar day": "days", "business days": "days", "business day": "days",
    "working days": "days", "working day": "days", "days": "days", "day": "days",
    "hours": "hours", "hour": "hours", "hrs": "hours", "h": "hours",
    "minutes": "minutes", "minute": "minutes", "min": "minutes",
    "weeks": "weeks", "week": "weeks", "months": "months", "month": "months", "years": "years", "year": "years",
    "seats": "seats", "seat": "seats", "users": "users", "user": "users", "invoices": "invoices",
    "invoice": "invoices", "gb": "GB", "percent": "percent", "per cent": "percent", "%": "percent",
    "euros": "euros", "euro": "euros", "eur": "euros", "€": "euros",
}
_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|" + "|".join(sorted(NUMBER_WORDS, key=len, reverse=True))
_UNIT = "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True))
_AFTER = re.compile(rf"(?<![\w.])(?P<num>{_NUM})(?:\s*-\s*|\s*)(?P<unit>{_UNIT})(?![a-z])", re.IGNORECASE)
_BEFORE = re.compile(rf"(?P<unit>€|\beur\b)\s*(?P<num>{_NUM})(?![\d])", re.IGNORECASE)
STOP = frozenset("""a about above after again against all also am an and any are as at be because been before being
below between both but by can cannot could did do does doing down during each else ever every few for from
further had has have having he her here hers him his how however i if in into is it its itself just may me might
more most must my no nor not now of off on once only or other our ours out over own per same shall she should so
some such than that the their theirs them then there these they this those through to too under until up upon us
very was we were what when where which while who whom why will with within would yes you your yours answer
question please""".split())


@dataclass(frozen=True, slots=True)
class Quantity:
    value: float
    unit: str  # the family: days, hours, euros, percent, ...
    start: int  # character span of the match in the text it was read from
    end: int

    def __str__(self) -> str:
        return f"{self.value:g} {self.unit}"


def _number(s: str) -> float:
    s = s.lower().replace(",", "")
    return float(NUMBER_WORDS[s]) if s in NUMBER_WORDS else float(s)


def quantities(text: str) -> list[Quantity]:
    """Every number with a unit in text, in order (a span is read once)."""
    found: list[Quantity] = []
    taken: list[tuple[int, int]] = []
    for rx in (_BEFORE, _AFTER):
        for m in rx.finditer(text):
            if any(m.start() < e and s < m.end() for s, e in taken):
                continue
            taken.append((m.start(), m.end()))
            found.append(Quantity(_number(m.group("num")), UNITS[m.group("unit").lower()], m.start(), m.end()))
    return sorted(found, key=lambda q: q.start)


def _stem(word: str) -> str:
    w = word.lower()
    for suffix in ("ations", "ation", "ments", "ment", "ings", "ing", "ies", "ed", "es", "s"):
        if w.endswith(suffix) and len(w) - len(suffix) >= 4:
            return w[: -len(suffix)]
    return w


def key_terms(text: str) -> set[str]:
    """Stems of the content words (four letters or more, not stop words)."""
    return {_stem(w) for w in re.findall(r"[A-Za-zÀ-ÿ]{4,}", text) if w.lower() not in STOP}


def named_entities(text: str) -> set[str]:
    """Capitalised words that do not start a sentence (Team, Business, Valencia), lower-cased."""
    out = set()
    for m in re.finditer(r"\b[A-Z][A-Za-zÀ-ÿ]+", text):
        before = text[: m.start()].rstrip()
        if not before or before[-1] in ".!?:\n\"“(":
            continue
        if m.group().lower() not in STOP:
            out.add(m.group().lower())
    return out


def supports(answer: str, passage: str) -> bool:
    """The passage carries the answer's content (the rule in the module docstring)."""
    stated = quantities(answer)
    names = named_entities(answer)
    terms = key_terms(answer)
    if not stated and not names and not terms:
        return False
    have = {(q.value, q.unit) for q in quantities(passage)}
    if any((q.value, q.unit) not in have for q in stated):
        return False
    low = passage.lower()
    if any(n not in low for n in names):
        return False
    if not stated:
        passage_terms = key_terms(passage)
        return len(terms & passage_terms) * 2 >= len(terms) > 0
    return True
