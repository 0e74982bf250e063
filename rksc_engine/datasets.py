"""Kept so that ``rksc_engine.datasets`` keeps importing: the generators and readers live in
``rksc_engine.evaluation.workloads``, the few-shot prompts in ``rksc_engine.reasoning.few_shot``."""

from .evaluation.workloads import *  # noqa: F403
from .reasoning.few_shot import (  # noqa: F401
    CHOICE_SYSTEM_PROMPT,
    SYSTEM_PROMPT,
    Problem,
    check_problems,
    few_shot_messages,
)
