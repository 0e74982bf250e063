"""Kept so that ``rksc_engine.cgee`` keeps importing: the online rules live in ``rksc_engine.reasoning.cgee``,
the offline calibration in ``rksc_engine.evaluation.calibration``."""

from .evaluation.calibration import calibrate  # noqa: F401
from .reasoning.cgee import *  # noqa: F403
from .reasoning.cgee import __all__  # noqa: F401
