"""A retrieval-augmented QA workload: a seeded corpus of fact paragraphs and queries whose context is
the relevant paragraph plus distractors in shuffled order, or any JSONL of the same shape by path.

The corpus is invented (towns that do not exist), so a correct answer can only come from the
context; each paragraph states several facts, and a question asks for one of them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_SYLLABLES = ("val", "mor", "ket", "dun", "sar", "bel", "tor", "quin", "ash", "lin", "grav", "ost",
              "pel", "rim", "hal", "zen", "cor", "fen", "drim", "wex")
_EXPORTS = ("blue glass", "copper wire", "goat cheese", "wool blankets", "clay pots", "dried figs",
            "silver rings", "pine resin", "salt fish", "olive oil", "paper lanterns", "iron nails")
_FOUNDERS = ("glassmakers", "fishermen", "monks", "miners", "weavers", "traders", "shepherds", "soldiers")
_FESTIVALS = ("lanterns", "kites", "bells", "masks", "boats", "apples", "candles", "drums")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December")
_RIVERS = ("Sarn", "Olm", "Vesk", "Tarrow", "Imber", "Kell", "Durra", "Wend")
_SIDES = ("eastern", "western", "northern", "southern")


@dataclass(frozen=True)
class FactParagraph:
    """One corpus paragraph and the facts it states (for the questions)."""

    name: str
    text: str
    facts: tuple[tuple[str, str], ...]  # (question, answer)


@dataclass(frozen=True)
class RagQuery:
    """A question with its retrieved context chunks (the relevant one among distractors)."""

    chunks: tuple[str, ...]
    question: str
    answer: str


def _town_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()
        if name not in taken:
            taken.add(name)
            return name


def fact_corpus(num: int = 60, seed: int = 0) -> list[FactParagraph]:
    """``num`` (>= 1) paragraphs of about 60 to 100 tokens, one invented town each."""
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"num must be an int >= 1, got {num!r}")
    rng = random.Random(seed)
    taken: set[str] = set()
    corpus = []
    for _ in range(num):
        name = _town_name(rng, taken)
        river, side = rng.choice(_RIVERS), rng.choice(_SIDES)
        year, founders = rng.randint(1100, 1899), rng.choice(_FOUNDERS)
        export, people = rng.choice(_EXPORTS), rng.randint(2, 90) * 1000
        festival, month = rng.choice(_FESTIVALS), rng.choice(_MONTHS)
        text = (f"The town of {name} lies on the {side} bank of the {river} river. It was founded in {year} "
                f"by a guild of {founders}, and its main export today is {export}. About {people:,} people "
                f"live there. Every year in {month} the town holds a festival of {festival}, which draws "
                f"visitors from the whole valley.")
        facts = (
            (f"What is the main export of {name}?", export),
            (f"In which year was {name} founded?", str(year)),
            (f"On which river does {name} lie?", river),
            (f"In which month is the festival of {name} held?", month),
        )
        corpus.append(FactParagraph(name, text, facts))
    return corpus


def rag_queries(corpus: Sequence[FactParagraph], num: int, chunks_per_query: int = 4,
                seed: int = 0) -> list[RagQuery]:
    """``num`` queries: each asks one fact of one paragraph, with that paragraph and
    ``chunks_per_query - 1`` others from ``corpus`` as context, in shuffled order."""
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"num must be an int >= 1, got {num!r}")
    if not 1 <= chunks_per_query <= len(corpus):
        raise ValueError(f"chunks_per_query must be in [1, {len(corpus)}] (the corpus size), got {chunks_per_query}")
    rng = random.Random(seed)
    queries = []
    for _ in range(num):
        target = rng.randrange(len(corpus))
        others = rng.sample([i for i in range(len(corpus)) if i != target], chunks_per_query - 1)
        picked = [target, *others]
        rng.shuffle(picked)
        question, answer = rng.choice(corpus[target].facts)
        queries.append(RagQuery(tuple(corpus[i].text for i in picked), question, answer))
    return queries


def load_rag_jsonl(path: str | Path, limit: int | None = None) -> list[RagQuery]:
    """Queries from a JSONL file of ``{"chunks": [...], "question": ..., "answer": ...}`` rows
    (``"context"`` is accepted for ``"chunks"``)."""
    queries = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            chunks = row.get("chunks", row.get("context"))
            if not (isinstance(chunks, list) and chunks and all(isinstance(c, str) for c in chunks)):
                raise ValueError(f"{path}:{number}: 'chunks' must be a non-empty list of strings")
            if not isinstance(row.get("question"), str):
                raise ValueError(f"{path}:{number}: 'question' must be a string")
            queries.append(RagQuery(tuple(chunks), row["question"], str(row.get("answer", ""))))
            if limit is not None and len(queries) >= limit:
                break
    return queries


RAG_SYSTEM_PROMPT = "Answer the question with a few words taken from the context."


def rag_messages(query: RagQuery, separator: str = "\n\n") -> list[dict[str, str]]:
    """Chat messages for ``query``: the context chunks joined by ``separator`` (a blank line, as
    LlamaIndex and LangChain join documents), with blank lines around them so each chunk is a
    segment of its own for retrieved-context reuse."""
    context = separator.join(query.chunks)
    return [
        {"role": "system", "content": RAG_SYSTEM_PROMPT},
        {"role": "user", "content": f"Context:{separator}{context}{separator}Question: {query.question}"},
    ]
