"""Multi-branch reasoning built on an engine: self-consistency, tree search, verifiers, the online CGEE
rules, early-stop rules, answer extraction and voting (exact, or clustered for free text) and few-shot prompts.

Nothing here reaches into the runtime: every module drives an engine through its public API
(``rksc_engine.protocol.Engine``), so the same code runs on ``RKSCEngine`` and ``RemoteEngine``.
"""

from .answers import (
    AnswerCluster,
    VoteConfig,
    VoteResult,
    answer_key,
    answer_similarity,
    cluster_answers,
    extract_gsm8k_answer,
    majority_vote,
    vote_answers,
)
from .early_stop import (
    AdaptiveConfig,
    AnsweredConfig,
    ConfidenceConfig,
    EarlyStopConfig,
    EarlyStopReport,
    LengthConfig,
)
from .few_shot import SYSTEM_PROMPT, Problem, check_problems, few_shot_messages
from .logprob_judge import LogprobJudgeVerifier
from .self_consistency import (
    BranchAnswer,
    ReasoningResult,
    VerificationReport,
    areason,
    extract_choice_letter,
    reason,
    regex_extractor,
    resolve_extractor,
    resolve_verifier,
)
from .tree_search import SearchNode, SearchResult, tree_search
from .verifier import CandidateScore, LLMJudgeVerifier, Verifier, as_verifier

__all__ = [
    "SYSTEM_PROMPT",
    "AdaptiveConfig",
    "AnswerCluster",
    "AnsweredConfig",
    "BranchAnswer",
    "CandidateScore",
    "ConfidenceConfig",
    "EarlyStopConfig",
    "EarlyStopReport",
    "LLMJudgeVerifier",
    "LengthConfig",
    "LogprobJudgeVerifier",
    "Problem",
    "ReasoningResult",
    "SearchNode",
    "SearchResult",
    "VerificationReport",
    "Verifier",
    "VoteConfig",
    "VoteResult",
    "answer_key",
    "answer_similarity",
    "areason",
    "as_verifier",
    "check_problems",
    "cluster_answers",
    "extract_choice_letter",
    "extract_gsm8k_answer",
    "few_shot_messages",
    "majority_vote",
    "reason",
    "regex_extractor",
    "resolve_extractor",
    "resolve_verifier",
    "tree_search",
    "vote_answers",
]
