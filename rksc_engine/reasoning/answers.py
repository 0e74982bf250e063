"""Answer extraction and voting for self-consistency."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####``, else the last number in the text; commas removed,
    a trailing ``.0`` dropped. None when the text has no number."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    numbers = _NUMBER.findall(tail) or (_NUMBER.findall(text) if "####" in text else [])
    if not numbers:
        return None
    value = numbers[0] if "####" in text else numbers[-1]
    value = value.replace(",", "").rstrip(".")
    if value.endswith(".0"):
        value = value[:-2]
    return value


def majority_vote(answers: Sequence[str | None]) -> tuple[str | None, Counter]:
    """The most frequent non-None answer (ties go to the one seen first) and the vote counts."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None, votes
    best = max(votes.values())
    for answer in answers:
        if answer is not None and votes[answer] == best:
            return answer, votes
    raise AssertionError("unreachable")
