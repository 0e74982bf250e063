"""Kept so that ``rksc_engine.early_stop`` keeps importing: the code lives in ``rksc_engine.reasoning.early_stop``."""

from .reasoning.early_stop import *  # noqa: F403
from .reasoning.early_stop import __all__  # noqa: F401
