"""``rksc bench``: the paper's tables reproduced side by side on the user's machine; and what the
scripts in ``benchmarks/`` share (``rksc_bench.harness``: flags, the bench lock, timing, results
files with the run's environment; the workloads and replays more than one script or a test needs).

This package is a front-end, not part of the engine: it drives ``rksc_engine`` in several
configurations (the arms) and, for the "what you run today" arm, ``langchain-huggingface`` over the
same weights. ``rksc_engine`` itself never imports it.
"""

from rksc_bench.config import ARMS, BenchConfig
from rksc_bench.paper import run_bench
from rksc_bench.report import ArmRecord, BenchReport, render_markdown

__all__ = ["ARMS", "ArmRecord", "BenchConfig", "BenchReport", "render_markdown", "run_bench"]
