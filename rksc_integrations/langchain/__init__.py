"""LangChain adapters: ``ChatRKSC`` (chat model), ``RKSCLLM`` (text-completion LLM) and
``MultiBranchReasoner`` (verified self-consistency as a Runnable), with ``RKSCEventCollector`` for
the rksc custom events they send."""

from rksc_integrations.langchain._base import CACHE_EVENT
from rksc_integrations.langchain.chat_models import ChatRKSC
from rksc_integrations.langchain.llms import RKSCLLM
from rksc_integrations.langchain.reasoner import (
    CGEE_EVENT,
    EARLY_EXIT_EVENT,
    EARLY_STOP_EVENT,
    REASONER_EVENTS,
    VOTE_EVENT,
    CacheReuse,
    CGEEDecision,
    MultiBranchReasoner,
    ReasonerBranch,
    ReasonerOutput,
    RKSCEvent,
    RKSCEventCollector,
)

__all__ = [
    "CACHE_EVENT",
    "CGEE_EVENT",
    "EARLY_EXIT_EVENT",
    "EARLY_STOP_EVENT",
    "REASONER_EVENTS",
    "VOTE_EVENT",
    "CGEEDecision",
    "CacheReuse",
    "ChatRKSC",
    "MultiBranchReasoner",
    "RKSCEvent",
    "RKSCEventCollector",
    "RKSCLLM",
    "ReasonerBranch",
    "ReasonerOutput",
]
