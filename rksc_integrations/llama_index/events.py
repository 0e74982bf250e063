"""rksc events as LlamaIndex instrumentation events.

Each class subclasses ``BaseEvent``, so any handler added to the root dispatcher
(``get_dispatcher().add_event_handler(handler)``) receives them next to LlamaIndex's own LLM events,
with the ``span_id`` of the LLM call that caused them.

Emitted: ``RKSCCacheReuseEvent`` (every call); ``RKSCASKSReuseEvent`` (every call whose completion
carries an ASKS decision); on a multi-branch call ``RKSCEarlyStopEvent`` (when it ran under early
stop, inside an ``RKSCBranchQueryEngine`` query), ``RKSCBranchVoteEvent``, ``RKSCCGEESkipEvent``
(skipped or not), ``RKSCVerificationEvent`` (when the verifier ran) and ``RKSCEarlyExitEvent`` (when a
verifier pass stopped before the judge model's last layer).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events import BaseEvent

# One dispatcher for the whole adapter; it propagates to the root, where users add handlers.
dispatcher = get_dispatcher("rksc_integrations.llama_index")


class RKSCCacheReuseEvent(BaseEvent):
    """How much of one call's prompt came from the prefix cache.

    Attributes:
        model_name: The engine's model.
        num_prompt_tokens: Tokens in the prompt.
        num_cached_tokens: Prompt tokens whose KV came from the cache.
        num_branches: Branches decoded over that one prefill.
        cache_tokens: Tokens held by the cache after the call.
        cache_bytes: Bytes held by the cache after the call.
    """

    model_name: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_branches: int = 1
    cache_tokens: int = 0
    cache_bytes: int = 0

    @property
    def num_computed_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_tokens

    @property
    def reuse_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @classmethod
    def class_name(cls) -> str:
        return "RKSCCacheReuseEvent"


class RKSCBranchVoteEvent(BaseEvent):
    """The self-consistency vote of one multi-branch call.

    Attributes:
        num_branches: Branches generated.
        answer: The winning answer key (None when no branch produced text).
        votes: Answer key -> branch count (for a clustered vote, each cluster's key -> its size).
        chosen_branch: Index of the branch whose text was returned.
        vote_method: The vote that ran, ``"exact"`` or ``"cluster"``.
    """

    num_branches: int
    answer: str | None
    votes: dict[str, int]
    chosen_branch: int
    vote_method: str = "exact"

    @classmethod
    def class_name(cls) -> str:
        return "RKSCBranchVoteEvent"


class RKSCEarlyStopEvent(BaseEvent):
    """What early stopping did for the branches of one multi-branch call (``EarlyStopReport``).

    Attributes:
        branches_launched: Branches the call ran.
        branches_cancelled: Branches an early-stop rule stopped.
        decode_tokens: Tokens decoded over all the call's branches.
        stopped_by: One ``{"branch_index", "rule"}`` per stopped branch, by branch index.
        stopped_request_by: The rule that ended the call early (``"decided"``, ``"adaptive"``), or None.
        confidence_threshold: The ``confidence`` rule's threshold on window means, once known; else None.
    """

    branches_launched: int
    branches_cancelled: int
    decode_tokens: int
    stopped_by: list[dict[str, Any]] = []
    stopped_request_by: str | None = None
    confidence_threshold: float | None = None

    @classmethod
    def class_name(cls) -> str:
        return "RKSCEarlyStopEvent"


class RKSCCGEESkipEvent(BaseEvent):
    """CGEE level 1: whether the confidence-weighted vote was decisive enough to skip verification.

    Attributes:
        skipped: True when verification was (or would be) skipped.
        reason: Why, with the thresholds.
        p: The winner's confidence-weighted share.
        lead: Its lead over the runner-up.
    """

    skipped: bool
    reason: str
    p: float
    lead: float

    @classmethod
    def class_name(cls) -> str:
        return "RKSCCGEESkipEvent"


class RKSCEarlyExitEvent(BaseEvent):
    """CGEE level 2: verifier passes that stopped before the last layer.

    Attributes:
        exit_layers: Per candidate, the layer its pass stopped at (None: not scored).
        num_layers: Decoder layers of the judge model.
        layers_saved: Layers not run, summed over candidates.
    """

    exit_layers: list[int | None]
    num_layers: int | None = None
    layers_saved: int = 0

    @classmethod
    def class_name(cls) -> str:
        return "RKSCEarlyExitEvent"


class RKSCVerificationEvent(BaseEvent):
    """The verifier's scores for the voted answers of one multi-branch call (CGEE did not skip).

    Attributes:
        answer: The answer picked (vote share times verifier score).
        scores: Candidate answer -> verifier score in [0, 1].
        verify_s: Wall time spent verifying.
    """

    answer: str | None
    scores: dict[str, float]
    verify_s: float = 0.0

    @classmethod
    def class_name(cls) -> str:
        return "RKSCVerificationEvent"


class RKSCASKSReuseEvent(BaseEvent):
    """ASKS: a prompt that realigned with a cached sequence after a differing span, or whose retrieved
    chunks were found cached, and whether that KV was reused (approximate) or recomputed.

    Built from ``Completion.asks``: an ``ASKSDecision`` or a ``ChunkReuseDecision``
    (``rksc_engine.results``); ``detail["kind"]`` says which (``"realign"`` or ``"chunks"``).

    Attributes:
        reused: Whether the cached remainder's KV was reused.
        sigma: Layer-weighted hidden-state similarity of the two differing spans.
        tau: The threshold ``sigma`` was compared with.
        num_reused_tokens: Prompt tokens served reused KV.
        num_recomputed_tokens: Remainder tokens computed instead.
        detail: Every field of the decision.
    """

    reused: bool
    sigma: float | None = None
    tau: float | None = None
    num_reused_tokens: int = 0
    num_recomputed_tokens: int = 0
    detail: dict[str, Any] = {}

    @classmethod
    def from_decision(cls, decision: Any) -> RKSCASKSReuseEvent:
        detail = dataclasses.asdict(decision) if dataclasses.is_dataclass(decision) else dict(vars(decision))
        return cls(
            reused=bool(getattr(decision, "reused", False)), sigma=getattr(decision, "sigma", None),
            tau=getattr(decision, "tau", None), num_reused_tokens=int(getattr(decision, "reused_tokens", 0)),
            num_recomputed_tokens=int(getattr(decision, "recomputed_tokens", 0)), detail=detail,
        )

    @classmethod
    def class_name(cls) -> str:
        return "RKSCASKSReuseEvent"


RKSC_EVENT_TYPES = (
    RKSCCacheReuseEvent, RKSCEarlyStopEvent, RKSCBranchVoteEvent, RKSCCGEESkipEvent, RKSCVerificationEvent,
    RKSCEarlyExitEvent, RKSCASKSReuseEvent,
)


def emit(event: BaseEvent) -> None:
    """Send ``event`` to every handler on the dispatcher chain."""
    dispatcher.event(event)
