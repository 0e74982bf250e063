"""LlamaIndex integration: ``RKSCLLM`` for query engines, chat engines and agents, rksc events in
LlamaIndex instrumentation, and self-consistency answering over one cached context.

Requires ``llama-index-core`` (the ``llama-index`` extra); the engine itself never imports it.
"""

from rksc_integrations.llama_index.branches import BranchDecision, RKSCBranchQueryEngine, normalise_answer
from rksc_integrations.llama_index.events import (
    RKSC_EVENT_TYPES,
    RKSCASKSReuseEvent,
    RKSCBranchVoteEvent,
    RKSCCacheReuseEvent,
    RKSCCGEESkipEvent,
    RKSCEarlyExitEvent,
    RKSCEarlyStopEvent,
    RKSCVerificationEvent,
)
from rksc_integrations.llama_index.llm import GENERATION_KWARGS, RKSCLLM

__all__ = [
    "GENERATION_KWARGS",
    "RKSC_EVENT_TYPES",
    "BranchDecision",
    "RKSCASKSReuseEvent",
    "RKSCBranchQueryEngine",
    "RKSCBranchVoteEvent",
    "RKSCCGEESkipEvent",
    "RKSCCacheReuseEvent",
    "RKSCEarlyExitEvent",
    "RKSCEarlyStopEvent",
    "RKSCLLM",
    "RKSCVerificationEvent",
    "normalise_answer",
]
