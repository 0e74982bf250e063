"""Kept so that ``rksc_engine.answers`` keeps importing: the code lives in ``rksc_engine.reasoning.answers``."""

from .reasoning.answers import extract_gsm8k_answer, majority_vote  # noqa: F401
