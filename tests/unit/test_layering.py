"""Package layering: the engine imports nothing above it, the ``rksc`` command sits on top of both
the engine and its bench front-end, and the benchmarks import the installed package."""

from __future__ import annotations

import ast
from pathlib import Path

import rksc_bench.cli
import rksc_engine.cli
from rksc_cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
UPPER_LAYERS = ("rksc_bench", "rksc_cli", "rksc_integrations", "langchain", "langchain_core", "llama_index")


def imported_modules(path: Path) -> set[str]:
    """Top-level names of the absolute imports in ``path`` (relative imports stay in the package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_engine_package_imports_nothing_from_the_layers_above_it():
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_modules(path) & set(UPPER_LAYERS))
        for path in sorted((ROOT / "rksc_engine").rglob("*.py"))
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"rksc_engine modules import upper layers: {offenders}"


def test_the_rksc_command_routes_ask_to_the_engine_and_bench_to_rksc_bench():
    parser = build_parser()
    assert parser.parse_args(["ask", "What is 2+3?"]).func is rksc_engine.cli.run, "rksc ask must run rksc_engine.cli.run"
    assert parser.parse_args(["bench"]).func is rksc_bench.cli.run, "rksc bench must run rksc_bench.cli.run"


def touches_sys_path(path: Path) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "path"
               and isinstance(node.value, ast.Name) and node.value.id == "sys"
               for node in ast.walk(ast.parse(path.read_text(), filename=str(path))))


def test_no_benchmark_edits_sys_path():
    edits = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "benchmarks").glob("*.py")) if touches_sys_path(path)]
    assert not edits, f"benchmarks must import the installed package, not edit sys.path: {edits}"
