"""Answer extraction, answer keys and the vote of self-consistency.

Two votes (``VoteConfig.method``):
    * ``"exact"``: branches vote for the answer their extractor returned, as it is. Short answers that
      a key makes canonical (a number from ``extract_gsm8k_answer``, a letter, ``answer_key``'s output)
      agree exactly when they are equal.
    * ``"cluster"``: for free text, where two branches rarely write the same sentence. Each answer is
      reduced to its ``answer_key``; answers are grouped by average-link agglomerative clustering on
      ``answer_similarity`` (a ROUGE-1-like F1 over content words) above ``VoteConfig.threshold``, and
      each cluster votes with the key of its representative, the member most similar to the others.

Promises:
    * Both votes are deterministic functions of the answers, their confidences and the question (ties
      go to the earlier branch), so the same branches always give the same clusters.
    * Answers that both state numbers but not the same ones, or of which one is negated and the other
      not, are never in one cluster; equal keys always are. Hence canonical numbers (what
      ``extract_gsm8k_answer`` returns) cluster exactly as the exact vote groups them.
    * A branch without an answer (None) casts no vote and belongs to no cluster.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "VOTE_METHODS", "AnswerCluster", "VoteConfig", "VoteResult", "answer_key", "answer_similarity",
    "cluster_answers", "extract_gsm8k_answer", "majority_vote", "question_words", "resolve_vote", "vote_answers",
]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")

VOTE_METHODS = ("exact", "cluster")
_ARTICLES = frozenset({"a", "an", "the"})
# Words that say nothing about which answer was given: left out when comparing answers, so that
# "the lighthouse is kept by Mara" and "Mara keeps it" are compared on what they name.
_FUNCTION_WORDS = _ARTICLES | frozenset({
    "is", "are", "was", "were", "be", "been", "being", "am", "do", "does", "did", "has", "have", "had",
    "of", "in", "on", "at", "to", "by", "for", "with", "from", "as", "into", "about",
    "and", "or", "but", "so", "also", "then", "that", "this", "these", "those", "which", "who", "what",
    "it", "its", "they", "their", "there", "he", "his", "she", "her", "we", "our", "you", "your", "i",
    "answer", "s",
})
# Words that turn a statement into its opposite: an answer with one and an answer without never agree.
_NEGATIONS = frozenset({"not", "no", "never", "none", "nothing", "nobody", "neither", "nor", "cannot"})
# A list marker opening the answer ("1. ", "2) ", "- "): formatting, not content. Only when text follows.
_LIST_MARKER = re.compile(r"^\s*(?:\d{1,2}[.)]|[-*\u2022])\s+(?=\S)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_POSSESSIVE = re.compile(r"['\u2019]s\b")
_NOT = re.compile(r"n['\u2019]t\b")
# A signed number (a minus only where no word character precedes it: "1990-2000" is two numbers), an
# unsigned one, or a run of letters.
_TOKEN = re.compile(r"(?<!\w)-\d+(?:\.\d+)?|\d+(?:\.\d+)?|[^\W\d_]+")
_IS_NUMBER = re.compile(r"-?\d")


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


def _canonical_number(token: str) -> str:
    """``12.50`` -> ``12.5``, ``12.0`` -> ``12``, ``-0`` -> ``0``: one spelling per value."""
    if "." in token:
        token = token.rstrip("0").rstrip(".")
    return "0" if token == "-0" else token


def answer_key(text: str) -> str | None:
    """The comparison key of a short answer: two answers with the same key say the same thing.

    Lower case (Unicode-folded); punctuation, quotes and the articles "a", "an", "the" removed; an
    opening list marker ("1. ") dropped; "n't" read as "not" and a possessive "'s" dropped; numbers
    without thousands separators, a leading "+" or trailing decimal zeros (``"1,000.50"`` ->
    ``"1000.5"``), a minus sign kept. The words are joined by single spaces. The key of a key is
    itself.

    Returns:
        The key, or None when nothing is left (the answer casts no vote).

    Example:
        >>> answer_key("The Eiffel Tower.") == answer_key("eiffel tower") == "eiffel tower"
        True
        >>> answer_key("1,000 ") == answer_key("+1000.0") == "1000"
        True
    """
    folded = unicodedata.normalize("NFKC", text).casefold().replace("\u2212", "-")
    folded = _LIST_MARKER.sub("", folded, count=1)
    folded = _POSSESSIVE.sub("", _NOT.sub(" not", _THOUSANDS.sub("", folded)))
    words = [_canonical_number(w) if _IS_NUMBER.match(w) else w for w in _TOKEN.findall(folded)]
    return " ".join(w for w in words if w not in _ARTICLES) or None


def _words(key: str) -> list[str]:
    return key.split()


def answer_similarity(first: str, second: str, ignored: frozenset[str] = frozenset()) -> float:
    """How far two answer keys say the same thing, in [0, 1].

    The F1 of their content words as multisets (ROUGE-1's F1): words of ``ignored`` (the question's
    words: an answer that restates the question agrees with every other on those) and function words
    do not count. 0 when both state numbers and not the same ones ("in 1931" against "in 1872"; a
    number only one of them mentions is just another word), or when only one of them is negated; 1
    when neither has a content word left (both only restate the question).

    Args:
        first, second: Answer keys (``answer_key``'s output; any text is keyed first).
        ignored: Words that do not count as agreement.
    """
    first_words = [w for w in _words(answer_key(first) or "") if w not in ignored]
    second_words = [w for w in _words(answer_key(second) or "") if w not in ignored]
    first_numbers = {w for w in first_words if _IS_NUMBER.match(w)}
    second_numbers = {w for w in second_words if _IS_NUMBER.match(w)}
    if first_numbers and second_numbers and first_numbers != second_numbers:
        return 0.0
    if bool(_NEGATIONS.intersection(first_words)) != bool(_NEGATIONS.intersection(second_words)):
        return 0.0
    first_content = Counter(w for w in first_words if w not in _FUNCTION_WORDS)
    second_content = Counter(w for w in second_words if w not in _FUNCTION_WORDS)
    if not first_content or not second_content:
        return float(not first_content and not second_content)
    shared = sum((first_content & second_content).values())
    return 2.0 * shared / (sum(first_content.values()) + sum(second_content.values()))


def question_words(question: str | None) -> frozenset[str]:
    """The words of ``question`` that ``answer_similarity`` should not count (none for None)."""
    return frozenset(_words(answer_key(question) or "")) if question else frozenset()


@dataclass(frozen=True)
class VoteConfig:
    """How branches' answers are voted.

    Attributes:
        method: ``"exact"`` (the default): each answer as extracted is its own candidate; right for
            numbers, letters and other canonical answers (``extract_gsm8k_answer``). ``"cluster"``:
            answers are keyed by ``answer_key`` and clustered by ``answer_similarity`` first; for free
            text. The ``decided`` and ``adaptive`` early-stop rules count each branch's own answer, so
            they do not apply to a clustered vote (``early_stop.for_clustered_vote``).
        threshold: The average ``answer_similarity`` two clusters need to merge, in (0, 1]. Default
            0.5: on average at least half the content words of two answers are shared (F1). 1 merges
            only answers with the same content words.
    """

    method: str = "exact"
    threshold: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.method, str):
            raise TypeError(f"vote.method must be one of {list(VOTE_METHODS)}, got {type(self.method).__name__}")
        if self.method not in VOTE_METHODS:
            raise ValueError(f"vote.method must be one of {list(VOTE_METHODS)}, got {self.method!r}")
        if not isinstance(self.threshold, (int, float)) or isinstance(self.threshold, bool):
            raise TypeError(f"vote.threshold must be a number in (0, 1], got {type(self.threshold).__name__}")
        if not 0.0 < self.threshold <= 1.0:  # also rejects NaN
            raise ValueError(f"vote.threshold must be in (0, 1], got {self.threshold}")


def resolve_vote(value: str | VoteConfig) -> VoteConfig:
    """The ``VoteConfig`` a caller means: a method name with the default threshold, or the config.

    Raises:
        ValueError: An unknown method name (the message lists the valid ones).
        TypeError: Anything else.
    """
    if isinstance(value, VoteConfig):
        return value
    if isinstance(value, str):
        return VoteConfig(method=value)
    raise TypeError(f"vote must be a VoteConfig or one of {list(VOTE_METHODS)}, got {type(value).__name__}")


@dataclass(frozen=True)
class AnswerCluster:
    """Branches whose answers the vote counted as one.

    Attributes:
        answer: The answer the cluster votes with: its representative's answer (its key, for a
            clustered vote).
        members: Indices of its branches, ascending.
        representative: The member whose answer stands for the cluster: for a clustered vote the one
            most similar to the other members, then the most confident; for an exact vote the most
            confident (ties: the earlier branch).
    """

    answer: str
    members: tuple[int, ...]
    representative: int

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class VoteResult:
    """What the vote did.

    Attributes:
        method: The vote that ran, ``"exact"`` or ``"cluster"``.
        answers: Per branch, the answer it voted for (its cluster's ``answer``), None for no vote.
        clusters: Largest first (ties: the one whose first member comes first).
        threshold: The clustering threshold (None for an exact vote).
    """

    method: str
    answers: tuple[str | None, ...]
    clusters: tuple[AnswerCluster, ...]
    threshold: float | None = None

    @property
    def sizes(self) -> tuple[int, ...]:
        """The clusters' sizes, largest first."""
        return tuple(c.size for c in self.clusters)

    @property
    def top_size(self) -> int:
        """Branches in the largest cluster (0 when no branch voted)."""
        return self.clusters[0].size if self.clusters else 0

    def cluster_of(self, answer: str) -> AnswerCluster:
        """The cluster voting with ``answer``."""
        for cluster in self.clusters:
            if cluster.answer == answer:
                return cluster
        raise KeyError(answer)


def _most_confident(indices: Sequence[int], confidences: Sequence[float]) -> int:
    """The index with the highest confidence, the earliest on ties (NaN counts as lowest)."""
    return max(indices, key=lambda i: (_rank(confidences[i]), -i))


def _rank(confidence: float) -> float:
    return -math.inf if math.isnan(confidence) else confidence


def _ordered(clusters: list[AnswerCluster]) -> tuple[AnswerCluster, ...]:
    return tuple(sorted(clusters, key=lambda c: (-c.size, c.members[0])))


def cluster_answers(keys: Sequence[str | None], confidences: Sequence[float] | None = None, *,
                    threshold: float = 0.5, question: str | None = None) -> tuple[AnswerCluster, ...]:
    """Average-link agglomerative clusters of answer keys.

    Equal keys start in one cluster. Then, while the two most similar clusters have an average
    pairwise ``answer_similarity`` (over their branches) of at least ``threshold``, they merge; among
    equally similar pairs the one with the earliest branches merges first. Costs O(k^3) for k distinct
    keys (k <= branches).

    Args:
        keys: Per branch, its answer key (``answer_key``), or None for no vote.
        confidences: Per branch, for the representative's tie-break; default all equal.
        threshold: In (0, 1].
        question: Its words do not count as agreement (see ``answer_similarity``).

    Returns:
        The clusters, largest first; each answers with its representative's key.

    Raises:
        ValueError: A threshold outside (0, 1], or not one confidence per key.
    """
    VoteConfig(method="cluster", threshold=threshold)  # the same checks, the same messages
    confidences = [1.0] * len(keys) if confidences is None else list(confidences)
    if len(confidences) != len(keys):
        raise ValueError(f"got {len(confidences)} confidences for {len(keys)} answers")
    groups: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(index)
    distinct = list(groups)  # first-seen order
    ignored = question_words(question)
    similarity = [[1.0 if a == b else answer_similarity(a, b, ignored) for b in distinct] for a in distinct]
    sizes = [len(groups[k]) for k in distinct]
    clusters = [[k] for k in range(len(distinct))]  # each a list of indices into distinct
    linkage = [row[:] for row in similarity]  # average similarity between clusters, by weight
    alive = list(range(len(distinct)))
    while True:
        best: tuple[float, int, int] | None = None
        for x_pos, x in enumerate(alive):
            for y in alive[x_pos + 1:]:
                if linkage[x][y] >= threshold and (best is None or linkage[x][y] > best[0]):
                    best = (linkage[x][y], x, y)
        if best is None:
            break
        _, x, y = best
        # Lance-Williams update for average linkage, weights in branches.
        for z in alive:
            if z not in (x, y):
                linkage[x][z] = linkage[z][x] = (sizes[x] * linkage[x][z] + sizes[y] * linkage[y][z]) / (sizes[x] + sizes[y])
        sizes[x] += sizes[y]
        clusters[x] += clusters[y]
        alive.remove(y)
    result = []
    for x in alive:
        atoms = clusters[x]
        # The representative: the most similar to the cluster's branches (a medoid), then confidence.
        agreement = {a: sum(len(groups[distinct[b]]) * similarity[a][b] for b in atoms) for a in atoms}
        best_agreement = max(agreement.values())
        candidates = [i for a in atoms if agreement[a] == best_agreement for i in groups[distinct[a]]]
        representative = _most_confident(sorted(candidates), confidences)
        members = tuple(sorted(i for a in atoms for i in groups[distinct[a]]))
        result.append(AnswerCluster(keys[representative], members, representative))
    return _ordered(result)


def vote_answers(answers: Sequence[str | None], confidences: Sequence[float] | None = None,
                 config: str | VoteConfig | None = None, *, question: str | None = None) -> VoteResult:
    """Group the branches' answers as ``config`` says (see the module docstring).

    Args:
        answers: Per branch, the extracted answer, None for none.
        confidences: Per branch, for choosing representatives; default all equal.
        config: A ``VoteConfig`` or a method name; default ``VoteConfig()`` (exact).
        question: For a clustered vote, the question whose words do not count as agreement.
    """
    config = VoteConfig() if config is None else resolve_vote(config)
    confidences = [1.0] * len(answers) if confidences is None else list(confidences)
    if len(confidences) != len(answers):
        raise ValueError(f"got {len(confidences)} confidences for {len(answers)} answers")
    if config.method == "exact":
        groups: dict[str, list[int]] = {}
        for index, answer in enumerate(answers):
            if answer is not None:
                groups.setdefault(answer, []).append(index)
        clusters = _ordered([AnswerCluster(a, tuple(m), _most_confident(m, confidences)) for a, m in groups.items()])
        return VoteResult("exact", tuple(answers), clusters)
    keys = [None if a is None else answer_key(a) for a in answers]
    clusters = cluster_answers(keys, confidences, threshold=config.threshold, question=question)
    voted: list[str | None] = [None] * len(answers)
    for cluster in clusters:
        for member in cluster.members:
            voted[member] = cluster.answer
    return VoteResult("cluster", tuple(voted), clusters, config.threshold)
