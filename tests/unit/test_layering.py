"""Package layering: the engine imports nothing above it (no adapters, no HTTP server), the ``rksc``
command sits on top of the engine and its bench and serve front-ends, and the benchmarks import the
installed package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import rksc_bench.cli
import rksc_engine.cli
import rksc_serve.cli
from rksc_cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
UPPER_LAYERS = ("rksc_bench", "rksc_cli", "rksc_integrations", "rksc_serve", "langchain", "langchain_core", "llama_index",
                "fastapi", "starlette", "uvicorn", "prometheus_client")


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


def test_the_rksc_command_routes_ask_to_the_engine_bench_to_rksc_bench_and_serve_to_rksc_serve():
    parser = build_parser()
    assert parser.parse_args(["ask", "What is 2+3?"]).func is rksc_engine.cli.run, "rksc ask must run rksc_engine.cli.run"
    assert parser.parse_args(["bench"]).func is rksc_bench.cli.run, "rksc bench must run rksc_bench.cli.run"
    assert parser.parse_args(["serve"]).func is rksc_serve.cli.run, "rksc serve must run rksc_serve.cli.run"


def test_the_rksc_command_imports_no_http_server_until_serve_runs():
    code = ("import sys, rksc_cli; rksc_cli.build_parser(); "
            "bad = [m for m in ('fastapi', 'uvicorn', 'prometheus_client') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, f"importing rksc_cli pulled in HTTP server modules (rksc --help must work without the serve extra): {out.stderr[-500:]}"


def touches_sys_path(path: Path) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "path"
               and isinstance(node.value, ast.Name) and node.value.id == "sys"
               for node in ast.walk(ast.parse(path.read_text(), filename=str(path))))


def test_no_benchmark_edits_sys_path():
    edits = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "benchmarks").glob("*.py")) if touches_sys_path(path)]
    assert not edits, f"benchmarks must import the installed package, not edit sys.path: {edits}"


# Private members of the engine that only its core may touch.
ENGINE_CORE = {"rksc_engine/engine.py"}
ENGINE_PRIVATE = {name for name in vars(__import__("rksc_engine.engine", fromlist=["RKSCEngine"]).RKSCEngine)
                  if name.startswith("_") and not name.startswith("__")} | {
    "_lock", "_stats", "_model", "_tokenizer", "_eos_ids", "_cacheable", "_cache_kwarg", "_scheduler",
    "_shared_prefix_probe", "_probe_failures", "_oom_since_relax"}


def test_nothing_outside_the_engine_core_touches_a_private_member_of_the_engine():
    offenders = []
    sources = [p for folder in ("rksc_engine", "rksc_integrations", "rksc_bench", "rksc_serve", "rksc_cli", "benchmarks")
               for p in (ROOT / folder).rglob("*.py")]
    for path in sources:
        if str(path.relative_to(ROOT)) in ENGINE_CORE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Attribute) and node.attr in ENGINE_PRIVATE):
                continue
            owner = node.value  # `engine._x`, `self.engine._x`, `self._engine._x`, `base._x`...
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if "engine" in name.lower() or name in ("base", "bf16", "old"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}.{node.attr}")
    assert not offenders, offenders
