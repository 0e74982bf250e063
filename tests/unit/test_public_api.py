"""The names rksc_engine exports, and the import paths the README, docs/ and cookbook document, stay put.

A user's ``from rksc_engine import X`` or ``from rksc_engine.reasoning import ...`` breaking on an upgrade
is a regression even when every test of the moved code passes; these tests fail on it. The re-export
modules left at the package's top from before it was cut into folders are gone (0.x, unreleased), and
stay gone.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from pathlib import Path

import pytest

import rksc_engine
from tests.markdown_docs import documentation_files

ROOT = Path(__file__).resolve().parents[2]

EXPORTED = {
    "ASKSConfig", "ASKSDecision", "CGEEConfig", "CancelToken", "Completion", "DefaultModelNotInstalled", "Engine",
    "EngineConfig", "EngineStats", "ForwardOutOfMemoryError", "LRUPolicy", "LocalEngine", "OmegaPolicy",
    "Prefilled", "PrefixCacheConfig", "PrefixMatch", "RKSCEngine", "RSBCMConfig", "RadixPrefixCache",
    "RemoteEngine", "RemoteServerError", "RequestCancelled", "RequestHandle", "SamplingParams",
    "SchedulerConfig", "SearchNode", "SearchResult", "ServedEngine", "ServerCapabilities", "StreamChunk",
}

# The homes of the names users were shown; each must keep importing.
DOCUMENTED = {
    "rksc_engine.evaluation.workloads": ["synthetic_problems", "load_gsm8k_jsonl", "ladder_problems", "ladder_shots",
                                         "synthetic_choice_problems"],
    "rksc_engine.reasoning.few_shot": ["few_shot_messages", "Problem", "SYSTEM_PROMPT"],
    "rksc_engine.reasoning.answers": ["extract_gsm8k_answer", "majority_vote"],
    "rksc_engine.reasoning.cgee": ["CGEEConfig", "exits_after_layer", "should_skip"],
    "rksc_engine.evaluation.calibration": ["calibrate"],
    "rksc_engine.reasoning.early_stop": ["EarlyStopConfig", "LengthConfig", "AdaptiveConfig", "ConfidenceConfig"],
    "rksc_engine.evaluation.rag_facts": ["fact_corpus", "rag_queries"],
    "rksc_engine.structured.constrained": ["ConstrainedDecoder", "decode_json"],
    "rksc_engine.structured.tools": ["decode_tool_call"],
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


# Modules that only re-exported names from their homes above; removed, with every caller updated.
REMOVED = ("rksc_engine.datasets", "rksc_engine.answers", "rksc_engine.cgee", "rksc_engine.early_stop",
           "rksc_engine.rag_workload", "rksc_integrations.langchain.constrained")


@pytest.mark.parametrize("module", REMOVED)
def test_a_removed_reexport_module_stays_removed(module):
    # Found at all, it must not be this checkout's file: a checkout tested beside another checkout's
    # editable install can still import that one's copy.
    spec = importlib.util.find_spec(module)
    assert spec is None or not Path(spec.origin).resolve().is_relative_to(ROOT), f"{module} is back: {spec.origin}"


def test_the_reasoning_package_reexports_the_objects_of_their_homes():
    from rksc_engine.reasoning import EarlyStopConfig as exported_config
    from rksc_engine.reasoning import early_stop, few_shot
    from rksc_engine.reasoning import few_shot_messages as exported_messages

    assert exported_messages is few_shot.few_shot_messages and exported_config is early_stop.EarlyStopConfig


def documented_imports() -> list[tuple[str, str, list[str]]]:
    """Every ``from rksc_engine... import ...`` (or ``rksc_integrations``) line of the README, the pages
    under docs/ and the cookbook's code cells, in code blocks of every kind."""
    texts = [(page.relative_to(ROOT).as_posix(), page.read_text(encoding="utf-8")) for page in documentation_files()]
    for notebook in sorted((ROOT / "cookbook").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        texts.append((notebook.name, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")))
    found = []
    for where, text in texts:
        for module, names in re.findall(r"^\s*from ((?:rksc_engine|rksc_integrations)[\w.]*) import ([\w, ]+)$", text, re.M):
            found.append((where, module, [n.strip().split(" as ")[0] for n in names.split(",") if n.strip()]))
    return found


def test_every_import_the_readme_docs_and_cookbook_show_resolves():
    found = documented_imports()
    pages = {where for where, _, _ in found}
    assert {"README.md", "docs/python_api.md"} <= pages, f"imports found only in {sorted(pages)}: the pattern went stale"
    broken = []
    for where, module, names in found:
        loaded = importlib.import_module(module)
        broken += [f"{where}: from {module} import {name}" for name in names if not hasattr(loaded, name)]
    assert not broken, broken
