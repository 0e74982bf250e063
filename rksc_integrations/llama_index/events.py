"""rksc events as LlamaIndex instrumentation events.

Each class subclasses ``BaseEvent``, so any handler added to the root dispatcher
(``get_dispatcher().add_event_handler(handler)``) receives them next to LlamaIndex's own LLM events,
with the ``span_id`` of the LLM call that caused them.

Emitted today: ``RKSCCacheReuseEvent`` (every call), ``RKSCBranchVoteEvent`` (every multi-branch
call) and ``RKSCCGEESkipEvent`` (every multi-branch call, skipped or not). ``RKSCEarlyExitEvent`` is
emitted when a verifier pass reports exit layers; ``RKSCASKSReuseEvent`` is defined so handlers can
be written now, and is emitted once the engine reports ASKS reuse.
"""

from __future__ import annotations

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
        answer: The winning normalised answer (None when no branch produced text).
        votes: Normalised answer -> branch count.
        chosen_branch: Index of the branch whose text was returned.
    """

    num_branches: int
    answer: str | None
    votes: dict[str, int]
    chosen_branch: int

    @classmethod
    def class_name(cls) -> str:
        return "RKSCBranchVoteEvent"


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


class RKSCASKSReuseEvent(BaseEvent):
    """ASKS reuse: state shared across branches or calls instead of recomputed.

    Not emitted yet: the engine does not report ASKS reuse. The fields are the minimum a handler
    needs (what was reused and how much); ``detail`` carries whatever else the engine reports.

    Attributes:
        num_reused_tokens: Tokens whose state was reused.
        detail: Engine-specific extra counters.
    """

    num_reused_tokens: int
    detail: dict[str, Any] = {}

    @classmethod
    def class_name(cls) -> str:
        return "RKSCASKSReuseEvent"


RKSC_EVENT_TYPES = (RKSCCacheReuseEvent, RKSCBranchVoteEvent, RKSCCGEESkipEvent, RKSCEarlyExitEvent, RKSCASKSReuseEvent)


def emit(event: BaseEvent) -> None:
    """Send ``event`` to every handler on the dispatcher chain."""
    dispatcher.event(event)
