"""Multi-branch answering: self-consistency over ``n`` branches of one cached prompt, verified with CGEE.

``RKSCLLM(branches=n)`` turns every LLM call into ``engine.generate_branches(prompt, n)`` (one
prefill, ``n`` sampled branches). Each branch's text is reduced to an answer key (default
``rksc_engine.reasoning.answer_key``: case, punctuation, articles and number formatting normalised)
and voted with confidence weights. By default the vote is clustered (``vote="cluster"``,
``rksc_engine.reasoning.answers``): free-text answers that say the same thing in other words form one
cluster, which votes with its representative's key; ``vote="exact"`` counts equal keys only. Under
``RKSCBranchQueryEngine`` the query's own words do not count as agreement (an answer restating the
question agrees with every other on them). The vote then goes through the engine's CGEE pipeline
(``rksc_engine.reasoning.self_consistency.verify_and_pick``): level 1 skips the verifier when the weighted winner's
share ``p >= tau_conf`` and its lead ``>= margin``; otherwise the verifier scores every voted answer
(by default the engine judging itself, Yes/No, over the call's own prompt, with CGEE level 2 layer
exit when ``CGEEConfig.exit_enabled``) and the answer with the largest ``share x score`` wins. The
returned text is the winning cluster's representative: for a clustered vote the branch most similar to
the rest of its cluster, for an exact vote the most confident branch with the winning key.
``verifier=None`` votes only.

``RKSCBranchQueryEngine`` wraps any query engine and puts every decision made while answering a
query into ``response.metadata["rksc"]``. Its ``early_stop`` setting (``RKSCEngine.reason``'s: by
default ``"decided"``, which never changes the vote's winner) applies to the multi-branch calls made
while it answers: their branches run under the engine's ``EarlyStopMonitor``, the branches it takes out
of the vote cast none, and each decision carries the monitor's report. Calls outside such a query run
every branch to its end. Under a clustered vote the rules that count votes per answer do not run:
``decided`` is dropped and ``adaptive`` refused (``rksc_engine.reasoning.early_stop.for_clustered_vote``).
"""

from __future__ import annotations

import contextvars
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import QueryBundle

from rksc_engine.config import SamplingParams
from rksc_engine.protocol import LocalEngine, ServedEngine
from rksc_engine.reasoning.answers import VoteConfig, VoteResult, majority_vote
from rksc_engine.reasoning.cgee import CGEEConfig
from rksc_engine.reasoning.early_stop import EarlyStopConfig, EarlyStopMonitor, for_clustered_vote, resolve_early_stop
from rksc_engine.reasoning.logprob_judge import LogprobJudgeVerifier
from rksc_engine.reasoning.self_consistency import branch_answers, verify_and_pick, vote_branches
from rksc_engine.reasoning.verifier import LLMJudgeVerifier, Verifier, as_verifier
from rksc_engine.results import Completion

AnswerKey = Callable[[str], "str | None"]
_SPACE = re.compile(r"\s+")
_STRIP = string.punctuation + string.whitespace + "\u201c\u201d\u2018\u2019"

# The judge for free-text answers: the question is the call's whole prompt (context included), so
# the model checks the answer against what it was given.
JUDGE_SYSTEM_PROMPT = "You check answers to questions about the given information. Reply with Yes or No only."
JUDGE_TEMPLATE = "{question}\n\nProposed answer: {answer}\nIs the proposed answer correct?"


@dataclass
class BranchCollector:
    """What one ``RKSCBranchQueryEngine`` query hands the ``RKSCLLM`` calls it makes.

    Attributes:
        decisions: Each multi-branch call's ``BranchDecision.as_dict()``, in order (the calls append).
        early_stop: The early stop those calls run under; None: every branch to its end.
        query: The query being answered; its words do not count as agreement in a clustered vote.
    """

    decisions: list = field(default_factory=list)
    early_stop: EarlyStopConfig | None = None
    query: str | None = None


# Set by RKSCBranchQueryEngine for the duration of one query; RKSCLLM reads it when a call starts.
_collector: contextvars.ContextVar[BranchCollector | None] = contextvars.ContextVar("rksc_branch_query", default=None)


def normalise_answer(text: str) -> str | None:
    """A lighter comparison key than ``answer_key`` (the default): lower case, runs of whitespace as
    one space, leading/trailing punctuation and quotes removed. None for an empty answer (it casts no
    vote)."""
    key = _SPACE.sub(" ", text.lower()).strip(_STRIP)
    return key or None


def make_verifier(engine: LocalEngine | ServedEngine, verifier: Any) -> Verifier | None:
    """The verifier of ``RKSCLLM(verifier=...)``: ``"judge"`` (the engine as a Yes/No judge over the
    prompt; over a server the log-prob judge, or None where the server sends no top log-probs), a
    ``Verifier``, a callable ``fn(question, candidates) -> scores``, or None (vote only).

    Raises:
        TypeError: Anything else.
    """
    if verifier is None:
        return None
    if isinstance(verifier, str):
        if verifier != "judge":
            raise ValueError(f"verifier must be 'judge', a Verifier, a callable or None, got {verifier!r}")
        if isinstance(engine, ServedEngine):
            if not engine.capabilities().top_logprobs:
                return None
            return LogprobJudgeVerifier(engine, system_prompt=JUDGE_SYSTEM_PROMPT, template=JUDGE_TEMPLATE)
        return LLMJudgeVerifier(engine, system_prompt=JUDGE_SYSTEM_PROMPT, template=JUDGE_TEMPLATE)
    resolved = as_verifier(verifier)
    if resolved is not None:
        return resolved
    raise TypeError(f"verifier must be 'judge', a Verifier, a callable or None, got {type(verifier).__name__}")


@dataclass(frozen=True)
class BranchDecision:
    """What self-consistency and CGEE decided for one multi-branch call.

    Attributes:
        num_branches: Branches generated.
        answer: The winning answer key (None when no branch produced an answer): for a clustered vote,
            the key of the winning cluster's representative.
        votes: Answer key -> branch count (a cluster's key -> its size, for a clustered vote).
        chosen_branch: Index of the branch whose text is returned: the representative of the
            winning cluster (see ``rksc_engine.reasoning.AnswerCluster``).
        cgee_skipped: CGEE level 1 found the vote decisive and skipped verification.
        cgee_reason: Why, with the thresholds.
        p: The confidence-weighted share of the vote winner.
        lead: Its lead over the runner-up.
        verified: Whether the verifier ran.
        scores: Answer key -> verifier score (empty unless verified).
        exit_layers: Per verified answer, the 0-based judge layer its pass stopped at (None: no layers).
        num_layers: Decoder layers of the judge model, when it has them.
        layers_saved: Judge layers not run thanks to CGEE level 2, summed over answers.
        verify_s: Wall time spent verifying.
        time_saved_s: CGEE's estimate of verifier time saved against full verification (see
            ``rksc_engine.reasoning.VerificationReport``); None when it cannot be estimated yet.
        early_stop: What early stopping did (``EarlyStopReport.as_dict()``); None when it was off.
        vote: Which vote ran, its clusters (answer, members, representative) and their sizes
            (``rksc_engine.reasoning.VoteResult``; a dict in ``as_dict()``).
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
    scores: dict[str, float] = field(default_factory=dict)
    exit_layers: list[int | None] = field(default_factory=list)
    num_layers: int | None = None
    layers_saved: int = 0
    verify_s: float = 0.0
    time_saved_s: float | None = 0.0
    early_stop: dict[str, Any] | None = None
    vote: VoteResult | None = None

    @property
    def exited_early(self) -> bool:
        """Whether some verifier pass stopped before the judge model's last layer."""
        return self.num_layers is not None and any(
            layer is not None and layer < self.num_layers - 1 for layer in self.exit_layers
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def branch_monitor(collector: BranchCollector | None, n: int, answer_key: AnswerKey,
                   params: SamplingParams, vote: VoteConfig | None = None) -> EarlyStopMonitor | None:
    """The early-stop monitor of an ``n``-branch call made during ``collector``'s query; None when
    the call runs every branch to its end (outside a query, early stop off, a single branch, or a
    clustered ``vote`` with no rule left for it).

    Raises:
        ValueError: A clustered vote under an early stop with ``adaptive``.
    """
    if collector is None or collector.early_stop is None or n == 1:
        return None
    early_stop = collector.early_stop
    if vote is not None and vote.method == "cluster":
        early_stop = for_clustered_vote(early_stop)
        if early_stop is None:
            return None
    return EarlyStopMonitor(early_stop, n=n, extract=answer_key, max_new_tokens=params.max_new_tokens)


def decide(
    completions: Sequence[Completion], answer_key: AnswerKey, cgee: CGEEConfig,
    *, question: str = "", verifier: Verifier | None = None, monitor: EarlyStopMonitor | None = None,
    vote: VoteConfig | None = None, query: str | None = None,
) -> BranchDecision:
    """Vote over ``completions``, verify unless CGEE skips, and pick the branch to return (see the
    module docstring). Without a verifier the confidence-weighted vote winner is the answer. With
    the ``monitor`` the branches ran under, only the branches its rules left in the vote vote.

    Args:
        question: What the verifier judges the answers against (the call's prompt).
        vote: Default ``VoteConfig()`` (exact).
        query: For a clustered vote, the question whose words do not count as agreement.

    Raises:
        Whatever the verifier raises; the engine stays usable (the judge cleans up after itself).
    """
    branches = branch_answers(completions, answer_key, monitor)
    result, voted = vote_branches(branches, vote or VoteConfig(), question=query)
    _, votes = majority_vote(result.answers)
    answer, report, _ = verify_and_pick(question, voted, verifier, cgee)
    chosen = 0 if answer is None else result.cluster_of(answer).representative
    return BranchDecision(
        num_branches=len(completions), answer=answer, votes=dict(votes), chosen_branch=chosen,
        cgee_skipped=report.skipped, cgee_reason=report.reason, p=report.p, lead=report.lead,
        verified=bool(report.scores), scores={s.answer: s.score for s in report.scores},
        exit_layers=list(report.exit_layers), num_layers=report.num_layers, layers_saved=report.layers_saved,
        verify_s=report.verify_s, time_saved_s=getattr(report, "time_saved_s", None),
        early_stop=monitor.report().as_dict() if monitor is not None else None, vote=result,
    )


def current_collector() -> BranchCollector | None:
    """The collector of the query being answered, if a ``RKSCBranchQueryEngine`` is running one."""
    return _collector.get()


class RKSCBranchQueryEngine(BaseQueryEngine):
    """A query engine that reports the branch decisions of an ``RKSCLLM(branches=n)`` it drives.

    Example:
        >>> llm = RKSCLLM(branches=5, branch_temperature=0.7)
        >>> qe = RKSCBranchQueryEngine(index.as_query_engine(llm=llm))
        >>> response = qe.query("Who maintains the lighthouse?")
        >>> response.metadata["rksc"]["final"]["vote"]["clusters"]  # equivalent answers, grouped
        >>> response.metadata["rksc"]["final"]["cgee_skipped"]
        >>> exact = RKSCLLM(branches=5, vote="exact")  # under an exact vote ``decided`` stops branches
        >>> final = RKSCBranchQueryEngine(index.as_query_engine(llm=exact)).query("...").metadata["rksc"]["final"]
        >>> final["early_stop"]["branches_cancelled"]

    ``response.metadata["rksc"]`` holds ``decisions`` (one dict per LLM call, in order) and
    ``final`` (the last call's, the one that produced the answer). For a streaming response
    ``final`` is None and ``decisions`` fills as the stream is consumed.

    Args:
        query_engine: The query engine to run.
        callback_manager: Default: the query engine's.
        early_stop: When the multi-branch calls of a query stop their branches: ``"decided"`` (the
            default; exact, once they cannot change the vote's winner), ``"answered"``, ``"adaptive"``,
            ``"confidence"``, ``"length"``, an ``EarlyStopConfig``, or None (every branch to its end). The rules read
            answers with the LLM's ``answer_key``. Under the LLM's default clustered vote ``decided``
            does not run and ``adaptive`` is refused (they count votes per answer); with
            ``RKSCLLM(vote="exact")`` every rule runs.

    Raises:
        TypeError, ValueError: A bad ``query_engine`` or ``early_stop`` (named), before anything runs.
    """

    def __init__(self, query_engine: BaseQueryEngine, callback_manager: CallbackManager | None = None, *,
                 early_stop: None | str | EarlyStopConfig = "decided") -> None:
        if not isinstance(query_engine, BaseQueryEngine):
            raise TypeError(f"query_engine must be a LlamaIndex BaseQueryEngine, got {type(query_engine).__name__}")
        self._early_stop = resolve_early_stop(early_stop)
        self.early_stop = early_stop
        self._inner = query_engine
        super().__init__(callback_manager or getattr(query_engine, "callback_manager", None) or CallbackManager())

    def _get_prompt_modules(self) -> dict[str, Any]:
        return {"query_engine": self._inner}

    def _get_prompts(self) -> dict[str, Any]:
        return {}

    def _update_prompts(self, prompts_dict: dict[str, Any]) -> None:
        pass

    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        collector = BranchCollector(early_stop=self._early_stop, query=query_bundle.query_str)
        token = _collector.set(collector)
        try:
            response = self._inner.query(query_bundle)
        finally:
            _collector.reset(token)
        return _attach(response, collector.decisions)

    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        collector = BranchCollector(early_stop=self._early_stop, query=query_bundle.query_str)
        token = _collector.set(collector)
        try:
            response = await self._inner.aquery(query_bundle)
        finally:
            _collector.reset(token)
        return _attach(response, collector.decisions)


def _attach(response: Any, decisions: list) -> Any:
    metadata = dict(response.metadata or {})
    # The list is shared, not copied: a streaming answer appends its decision as it is consumed.
    metadata["rksc"] = {"decisions": decisions, "final": decisions[-1] if decisions else None}
    response.metadata = metadata
    return response
