"""Multi-branch answering: self-consistency over ``n`` branches of one cached prompt.

``RKSCLLM(branches=n)`` turns every LLM call into ``engine.generate_branches(prompt, n)`` (one
prefill, ``n`` sampled branches). Branch texts are compared by an answer key (default
``normalise_answer``: lower-cased, whitespace collapsed, surrounding punctuation removed), the most
frequent key wins (``rksc_engine.answers.majority_vote``; ties go to the branch seen first), and the
most confident branch with that key is the returned text. The CGEE level-1 decision on the same
vote (confidence-weighted share ``p`` and ``lead``, ``rksc_engine.cgee.should_skip``) is reported:
``skipped=True`` means the vote is decisive enough that verification is unnecessary. No verifier runs
in the adapter, so an undecided vote still returns the majority answer; the report says so.

``RKSCBranchQueryEngine`` wraps any query engine and puts every decision made while answering a
query into ``response.metadata["rksc"]``.
"""

from __future__ import annotations

import contextvars
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import QueryBundle

from rksc_engine.answers import majority_vote
from rksc_engine.cgee import CGEEConfig, should_skip, summarise_votes
from rksc_engine.types import Completion

AnswerKey = Callable[[str], "str | None"]
_SPACE = re.compile(r"\s+")
_STRIP = string.punctuation + string.whitespace + "\u201c\u201d\u2018\u2019"

# Set by RKSCBranchQueryEngine for the duration of one query; RKSCLLM appends its decisions here.
_collector: contextvars.ContextVar[list | None] = contextvars.ContextVar("rksc_branch_decisions", default=None)


def normalise_answer(text: str) -> str | None:
    """The comparison key of a free-text answer: lower case, runs of whitespace as one space,
    leading/trailing punctuation and quotes removed. None for an empty answer (it casts no vote)."""
    key = _SPACE.sub(" ", text.lower()).strip(_STRIP)
    return key or None


@dataclass(frozen=True)
class BranchDecision:
    """What self-consistency decided for one multi-branch call.

    Attributes:
        num_branches: Branches generated.
        answer: The winning answer key (None when no branch produced an answer).
        votes: Answer key -> branch count.
        chosen_branch: Index of the branch whose text is returned.
        cgee_skipped: CGEE level 1 says the vote is decisive enough to skip verification.
        cgee_reason: Why, with the thresholds.
        p: The confidence-weighted share of the CGEE winner.
        lead: Its lead over the runner-up.
        verified: Whether a verifier ran (always False here: the adapter has none).
    """

    num_branches: int
    answer: str | None
    votes: dict[str, int]
    chosen_branch: int
    cgee_skipped: bool
    cgee_reason: str
    p: float
    lead: float
    verified: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide(completions: Sequence[Completion], answer_key: AnswerKey, cgee: CGEEConfig) -> BranchDecision:
    """Vote over ``completions`` and pick the branch to return (see the module docstring)."""
    keys = [answer_key(c.text) for c in completions]
    answer, votes = majority_vote(keys)
    summary = summarise_votes(keys, [c.confidence for c in completions])
    skipped, reason = should_skip(summary, cgee)
    if answer is None:
        chosen = 0
    else:
        chosen = max((i for i, k in enumerate(keys) if k == answer), key=lambda i: completions[i].confidence)
    return BranchDecision(
        num_branches=len(completions), answer=answer, votes=dict(votes), chosen_branch=chosen,
        cgee_skipped=skipped, cgee_reason=reason, p=summary.p, lead=summary.lead,
    )


def current_collector() -> list | None:
    """The decision list of the query being answered, if a ``RKSCBranchQueryEngine`` is running one."""
    return _collector.get()


class RKSCBranchQueryEngine(BaseQueryEngine):
    """A query engine that reports the branch decisions of an ``RKSCLLM(branches=n)`` it drives.

    Example:
        >>> llm = RKSCLLM(branches=5, branch_temperature=0.7)
        >>> qe = RKSCBranchQueryEngine(index.as_query_engine(llm=llm))
        >>> response = qe.query("Who maintains the lighthouse?")
        >>> response.metadata["rksc"]["final"]["cgee_skipped"]

    ``response.metadata["rksc"]`` holds ``decisions`` (one dict per LLM call, in order) and
    ``final`` (the last call's, the one that produced the answer). For a streaming response
    ``final`` is None and ``decisions`` fills as the stream is consumed.
    """

    def __init__(self, query_engine: BaseQueryEngine, callback_manager: CallbackManager | None = None) -> None:
        if not isinstance(query_engine, BaseQueryEngine):
            raise TypeError(f"query_engine must be a LlamaIndex BaseQueryEngine, got {type(query_engine).__name__}")
        self._inner = query_engine
        super().__init__(callback_manager or getattr(query_engine, "callback_manager", None) or CallbackManager())

    def _get_prompt_modules(self) -> dict[str, Any]:
        return {"query_engine": self._inner}

    def _get_prompts(self) -> dict[str, Any]:
        return {}

    def _update_prompts(self, prompts_dict: dict[str, Any]) -> None:
        pass

    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        decisions: list = []
        token = _collector.set(decisions)
        try:
            response = self._inner.query(query_bundle)
        finally:
            _collector.reset(token)
        return _attach(response, decisions)

    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        decisions: list = []
        token = _collector.set(decisions)
        try:
            response = await self._inner.aquery(query_bundle)
        finally:
            _collector.reset(token)
        return _attach(response, decisions)


def _attach(response: Any, decisions: list) -> Any:
    metadata = dict(response.metadata or {})
    # The list is shared, not copied: a streaming answer appends its decision as it is consumed.
    metadata["rksc"] = {"decisions": decisions, "final": decisions[-1] if decisions else None}
    response.metadata = metadata
    return response
