"""The names rksc_engine exports, and the import paths the README and cookbook document, stay put.

A user's ``from rksc_engine import X`` or ``from rksc_engine.datasets import ...`` breaking on an upgrade
is a regression even when every test of the moved code passes; these tests fail on it.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

import rksc_engine

ROOT = Path(__file__).resolve().parents[2]

EXPORTED = {
    "ASKSConfig", "ASKSDecision", "CGEEConfig", "Completion", "DefaultModelNotInstalled", "Engine",
    "EngineConfig", "EngineStats", "ForwardOutOfMemoryError", "LRUPolicy", "LocalEngine", "OmegaPolicy",
    "Prefilled", "PrefixCacheConfig", "PrefixMatch", "RKSCEngine", "RSBCMConfig", "RadixPrefixCache",
    "RemoteEngine", "RemoteServerError", "RequestCancelled", "RequestHandle", "SamplingParams",
    "SchedulerConfig", "SearchNode", "SearchResult", "ServedEngine", "ServerCapabilities", "StreamChunk",
}

# Paths users were shown before the package was cut into folders; each must keep importing.
DOCUMENTED = {
    "rksc_engine.datasets": ["synthetic_problems", "few_shot_messages", "load_gsm8k_jsonl", "ladder_problems",
                             "ladder_shots", "Problem", "SYSTEM_PROMPT", "synthetic_choice_problems"],
    "rksc_engine.answers": ["extract_gsm8k_answer", "majority_vote"],
    "rksc_engine.cgee": ["calibrate", "CGEEConfig", "exits_after_layer", "should_skip"],
    "rksc_engine.early_stop": ["EarlyStopConfig", "LengthConfig", "AdaptiveConfig", "ConfidenceConfig"],
    "rksc_engine.rag_workload": ["fact_corpus", "rag_queries"],
    "rksc_engine.config": ["ASKSConfig", "RSBCMConfig", "EngineConfig", "SamplingParams"],
    "rksc_engine.reasoning": ["reason", "areason", "ReasoningResult", "tree_search", "few_shot_messages",
                              "EarlyStopConfig", "LLMJudgeVerifier", "LogprobJudgeVerifier"],
}


def test_the_package_exports_exactly_its_documented_names():
    assert set(rksc_engine.__all__) == EXPORTED, (
        f"rksc_engine.__all__ changed: added {sorted(set(rksc_engine.__all__) - EXPORTED)}, "
        f"removed {sorted(EXPORTED - set(rksc_engine.__all__))}; update EXPORTED only on purpose")
    missing = [name for name in rksc_engine.__all__ if not hasattr(rksc_engine, name)]
    assert not missing, f"named in __all__ but not importable: {missing}"


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_a_documented_import_path_keeps_working(module):
    loaded = importlib.import_module(module)
    missing = [name for name in DOCUMENTED[module] if not hasattr(loaded, name)]
    assert not missing, f"{module} lost {missing}"


def test_an_old_path_and_its_new_home_give_the_same_object():
    from rksc_engine.datasets import few_shot_messages, synthetic_problems
    from rksc_engine.evaluation.workloads import synthetic_problems as moved_problems
    from rksc_engine.reasoning.few_shot import few_shot_messages as moved_messages

    assert synthetic_problems is moved_problems and few_shot_messages is moved_messages


def documented_imports() -> list[tuple[str, str, list[str]]]:
    """Every ``from rksc_engine... import ...`` line of the README and the cookbook's code cells."""
    texts = [("README.md", (ROOT / "README.md").read_text())]
    for notebook in sorted((ROOT / "cookbook").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        texts.append((notebook.name, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")))
    found = []
    for where, text in texts:
        for module, names in re.findall(r"^\s*from (rksc_engine[\w.]*) import ([\w, ]+)$", text, re.M):
            found.append((where, module, [n.strip().split(" as ")[0] for n in names.split(",") if n.strip()]))
    return found


def test_every_import_the_readme_and_cookbook_show_resolves():
    found = documented_imports()
    assert found, "the README and cookbook show no rksc_engine import: the pattern above went stale"
    broken = []
    for where, module, names in found:
        loaded = importlib.import_module(module)
        broken += [f"{where}: from {module} import {name}" for name in names if not hasattr(loaded, name)]
    assert not broken, broken
